"""Command-line glue: bad input refused in one line (``error: ...``, exit 2) before anything heavy
is imported or written; the multirun job's experiment directory."""

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from pipeline.errors import BuildError, ConfigError

CONF = Path(__file__).resolve().parent.parent / "conf"
GROUPS = tuple(sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "hydra"))  # conf/'s option groups
NULLABLE_GROUPS = ("experiment",)
# Hydra's flags that take a value (the value is not an override)
VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def overrides_of(argv: list[str]) -> list[str]:
    """The ``key=value`` overrides of a command line, without Hydra's flags and their values."""
    out, flag = [], None  # flag: "value" or "optional" when the next word may be a flag's value
    for arg in argv:
        if flag == "value" or (flag == "optional" and "=" not in arg and not arg.startswith("-")):
            flag = None  # the flag's value (--info's is optional)
        elif arg.startswith("-") and not arg.startswith(("~", "+")):
            flag = ("optional" if arg in ("--info", "-i") else "value") if arg in VALUE_FLAGS else None
        else:
            flag = None
            out.append(arg)
    return out


def check_overrides(argv: list[str]) -> None:
    """Every override against the schema and the group options, each value of a sweep included;
    Hydra's own messages span several lines and come after composing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from pipeline.config import check_setting

    parser = OverridesParser.create()
    for arg in overrides_of(argv):
        try:
            (override,) = parser.parse_overrides([arg])
        except HydraException as err:
            raise ConfigError(f"{arg} is not an override Hydra can parse: {_first_line(err)}") from None
        key = override.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        try:
            values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except HydraException:  # a sweep Hydra expands itself (glob over group options)
            continue
        if key in GROUPS:
            options = sorted(p.stem for p in (CONF / key).glob("*.yaml"))
            for choice in values:
                if override.is_delete() or (choice is None and key in NULLABLE_GROUPS):
                    continue
                if choice not in options:
                    raise ConfigError(f"{key}={choice} is not an option of the '{key}' group; choose one of: {', '.join(options)}")
        elif override.is_delete():
            raise ConfigError(f"{arg}: a setting cannot be deleted; give it a value instead")
        else:
            for value in values:
                check_setting(key, value)


def slurm_sweep(argv: list[str]) -> bool:
    """Whether the command line sends its sweep to SLURM."""
    return any(a.lstrip("+") in ("hydra/launcher=slurm", "hydra/launcher=submitit_slurm") for a in argv)


def check_slurm(argv: list[str]) -> None:
    """A sweep sent to SLURM (``hydra/launcher=slurm``) needs ``sbatch`` and a controller that answers: checked
    before Hydra writes any job, so that a missing cluster is one line rather than a job submission's traceback."""
    if not slurm_sweep(argv):
        return
    import shutil
    import subprocess

    start = "start the one-host cluster with `bash .ci/slurm-up` (README: Sweeps), or run on a cluster's login node"
    if shutil.which("sbatch") is None:
        raise ConfigError(f"hydra/launcher=slurm: sbatch is not on PATH (SLURM is not installed here); {start}")
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"hydra/launcher=slurm: sinfo did not answer ({err}); {start}") from None
    if proc.returncode != 0:
        reason = _first_line(RuntimeError(proc.stderr)) if proc.stderr.strip() else f"exit {proc.returncode}"
        raise ConfigError(f"hydra/launcher=slurm: slurmctld is not reachable (sinfo: {reason}); {start}")


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def one_line(err: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line errors as one line: the message (its hints joined by
    '; ') and its cause."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]
    message = "; ".join(lines) or type(err).__name__
    cause = err.__cause__
    if cause is not None and _first_line(cause) not in message:
        message += f": {_first_line(cause)}"
    return message


def main(hydra_main, argv: list[str]) -> None:
    """Run the Hydra entry point ``hydra_main`` with every error a user can fix as one line."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        check_overrides(argv)
        check_slurm(argv)
    except ConfigError as err:
        fail(str(err))
    if slurm_sweep(argv):
        from pipeline.build.slurm_state import watch_without_accounting

        watch_without_accounting()  # jobs' states where the cluster keeps no accounting (build/slurm_state.py)
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises, the lines below format
    try:
        hydra_main()
    except (ConfigError, BuildError) as err:
        fail(str(err))
    except (HydraException, OmegaConfBaseException) as err:
        fail(one_line(err))
    except Exception as err:
        if not any("hydra/launcher=" in a for a in argv):
            raise
        # a job's failure as submitit reports it (its first line and the job's own last one), or a job SLURM killed
        # before its result, whose row the sweep writes; the sweep's other jobs go on in their processes or on the
        # cluster, and each writes its row of summary.csv
        from pipeline.build.slurm_state import record_lost_job

        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        said = record_lost_job(str(err)) or (f"{lines[0] if lines else type(err).__name__}"
                                             + (f" ... {lines[-1]}" if len(lines) > 1 else ""))
        fail(f"sweep: {said}; the sweep's other jobs finish on their own and write their rows to its summary.csv")


def run_build(cfg: DictConfig) -> None:
    """The task of one job: in a multirun each job builds into its own experiment directory,
    ``<output_root>/<experiment_name>/<its overrides>/`` (Hydra's override_dirname), and records its
    row of the sweep's report (``pipeline/sweep.py``), failed or not."""
    import time

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from pipeline.build.runner import build
    from pipeline.quiet import filtered_stderr

    hydra_cfg = HydraConfig.get()
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    exp_dir = None
    if sweeping:
        exp_dir = Path(cfg.output_root) / cfg.experiment_name
        if name := hydra_cfg.job.override_dirname.replace("/", "_"):
            exp_dir /= name
    start, version, decode = time.perf_counter(), None, None
    if sweeping and os.environ.get("SLURM_JOB_ID"):
        _stop_on_sigterm()
    try:
        with filtered_stderr(enabled=not cfg.verbose) as noise:
            if cfg.rebuild:
                from pipeline.build.rebuild import rebuild

                version = rebuild(Path(cfg.rebuild))
            else:
                version = build(cfg, list(hydra_cfg.overrides.task), hydra_cfg, exp_dir)  # dry_run=true: the plan only
            if version is not None and cfg.measure_decode_steps:
                decode = _measure(cfg, version)
        if noise["hidden"]:
            print(f"  ({noise['hidden']} lines of known library warnings hidden; verbose=true shows them)")
    except Exception as err:
        if sweeping and not cfg.dry_run:
            status = err.status if isinstance(err, KilledBySlurm) else "failed"
            _record(cfg, hydra_cfg, None, time.perf_counter() - start, f"{type(err).__name__}: {err}", None, status)
        if not isinstance(err, (ConfigError, BuildError)):
            raise
        if not sweeping:
            fail(str(err))
        # a sweep goes on with its other jobs; Hydra raises the first failure at the end
        print(f"error: job {hydra_cfg.job.num} ({hydra_cfg.job.override_dirname}): {err}", file=sys.stderr)
        raise
    if sweeping and version is not None:
        _record(cfg, hydra_cfg, version, time.perf_counter() - start, None, decode)


def _measure(cfg: DictConfig, version: Path) -> dict | None:
    """measure_decode_steps: decode tokens/s of the artifact through its session (CPU backends)."""
    from pipeline.backends import backend

    if backend(cfg.backend.name).needs_gpu:
        print(f"  decode speed not measured: backend={cfg.backend.name} runs through bench/cuda_build.sh")
        return None
    from pipeline.runtime.throughput import decode_rate

    rate = decode_rate(version, steps=cfg.measure_decode_steps)
    print(f"  decode: {rate['tokens_per_s']:.1f} tokens/s ({rate['sequences']} sequences, median step "
          f"{rate['step_ms']:.2f} ms over {rate['steps']} steps after {rate['context']} tokens each)")
    return rate


def _record(cfg, hydra_cfg, version, seconds, error, decode, status: str | None = None) -> None:
    from pipeline.build.sweep import job_row, record_job

    job = {"num": hydra_cfg.job.num, "overrides": hydra_cfg.job.override_dirname}
    record_job(Path(hydra_cfg.sweep.dir), job_row(cfg, job, version, seconds, error, decode, status))


class KilledBySlurm(Exception):
    """SLURM ended this job (scancel, its time limit): raised from the SIGTERM that comes before its SIGKILL, so that
    the build moves its work out of the way (no version, no half cache entry) and the sweep's row says so."""

    def __init__(self, status: str):
        super().__init__(status)  # the one argument: submitit pickles the exception back to the sweep
        self.status = status

    def __str__(self) -> str:
        return f"SLURM ended the job ({self.status}: SIGTERM before its kill)"


def _seconds(slurm_time: str) -> float:
    """SLURM's [D-][HH:]MM:SS as seconds; UNLIMITED (or anything else) as infinity."""
    days, _, clock = slurm_time.rpartition("-")
    try:
        parts = [int(x) for x in clock.split(":")]
    except ValueError:
        return float("inf")
    while len(parts) < 3:
        parts.insert(0, 0)
    return (int(days or 0) * 24 + parts[0]) * 3600 + parts[1] * 60 + parts[2]


def _stop_on_sigterm() -> None:
    """submitit ignores SIGTERM in a job (it waits for its own signal to checkpoint): in a build, SIGTERM stops it.
    The job's record says why: at its time limit (timeout) or before it (cancelled: scancel, a node going down).
    The limit is read here, at the job's start: after SIGTERM, SLURM kills the job KillWait seconds later, and the
    cleanup, the row and submitit's result must all fit in them (a job killed before its result is an error the
    sweep reports, but it has no row)."""
    import signal
    import subprocess
    import time

    end = float("inf")  # when SLURM's limit ends the job, on this clock; unknown: every SIGTERM is a cancel
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", os.environ["SLURM_JOB_ID"]], capture_output=True,
                             text=True, timeout=30).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        run, limit = _seconds(fields.get("RunTime", "?")), _seconds(fields.get("TimeLimit", "UNLIMITED"))
        if run < float("inf"):
            end = time.time() - run + limit
    except (OSError, subprocess.TimeoutExpired):
        pass

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # SLURM may send it again; the cleanup runs once
        raise KilledBySlurm("timeout" if time.time() >= end - 1 else "cancelled")  # RunTime counts whole seconds

    signal.signal(signal.SIGTERM, stop)
