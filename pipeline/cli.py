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
    except ConfigError as err:
        fail(str(err))
    os.environ.setdefault("HYDRA_FULL_ERROR", "1")  # Hydra raises, the lines below format
    try:
        hydra_main()
    except (ConfigError, BuildError) as err:
        fail(str(err))
    except (HydraException, OmegaConfBaseException) as err:
        fail(one_line(err))


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
            _record(cfg, hydra_cfg, None, time.perf_counter() - start, f"{type(err).__name__}: {err}", None)
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


def _record(cfg, hydra_cfg, version, seconds, error, decode) -> None:
    from pipeline.build.sweep import job_row, record_job

    job = {"num": hydra_cfg.job.num, "overrides": hydra_cfg.job.override_dirname}
    record_job(Path(hydra_cfg.sweep.dir), job_row(cfg, job, version, seconds, error, decode))
