"""The runner: checks the config, runs the stages in order, owns the output
directory and the build record.

A build works in ``outputs/<experiment>/.building-<id>/`` and becomes the next
version ``outputs/<experiment>/vNNNN/`` only when every stage succeeded, so a
failed or interrupted build never leaves a version that looks complete (a
failed one is kept under ``.failed/`` to inspect). An existing version built
from the same config, sources and tools is reused instead of rebuilt.
"""

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.errors import ConfigError
from pipeline.plan import compare_programs, print_plan, rebuild  # noqa: F401  (rebuild: the CLI's)
from pipeline.stages import check_order

SRC = Path(__file__).resolve().parent


def check_config(cfg: DictConfig) -> list:
    """Everything that can be rejected before any file is written, from the config alone (no torch
    unless backend=cuda asks whether there is a GPU): the stage order, unknown settings, closed sets,
    the model's shapes, the KV layout, the validation episode against it and the build's memory."""
    from pipeline.backends import backend
    from pipeline.config import DTYPES, GPU_RUNTIMES, METRICS, unknown_settings
    from pipeline.feasibility import check_draft, check_episode, check_memory, check_model, check_vision
    from pipeline.kv.layouts import model_layouts
    from pipeline.models.args import draft_args, model_args
    from pipeline.models.families import family

    if unknown := unknown_settings(cfg):
        raise ConfigError(unknown[0])
    plan = check_order(list(cfg.stages))
    stages = {s.name for s in plan}
    family(cfg.model.family)
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={cfg.model.dtype} is not a supported dtype; choose one of {', '.join(DTYPES)}")
    target = backend(cfg.backend.name)
    if cfg.validate.metric not in METRICS:
        raise ConfigError(f"validate.metric={cfg.validate.metric} is not a metric; choose {' or '.join(METRICS)}")
    if cfg.validate.runtime not in GPU_RUNTIMES:
        raise ConfigError(f"validate.runtime={cfg.validate.runtime} is not a GPU runtime; choose {' or '.join(GPU_RUNTIMES)}")
    if cfg.memory_budget_gb is not None and not cfg.memory_budget_gb > 0:
        raise ConfigError(f"memory_budget_gb={cfg.memory_budget_gb} must be a positive number of GB (null: this machine's memory)")
    args = model_args(cfg.model)
    check_model(args)
    draft = None
    if cfg.draft.name != "none":
        draft = draft_args(cfg.draft, args)
        check_draft(draft, args, cfg.draft)
    layouts = model_layouts(cfg.kv, args, cfg.model.causal, draft)
    vision = None
    if cfg.vision.name != "none":
        if "export" in stages and "export_vision" not in stages:
            raise ConfigError(f"vision={cfg.vision.name} needs the export_vision stage: add it to stages "
                              "(stages=[export_vision,export,...]) or choose vision=none")
        vision = check_vision(cfg.vision, args, layouts["target"])
    if "validate" in stages:
        check_episode(cfg.validate, layouts["target"], draft, vision)
    if "lower_kv" in stages:  # the KV stores exist from lower_kv on
        check_memory(layouts, args, cfg.model.dtype, cfg.memory_budget_gb)
    needs_gpu = {"compile", "validate"} & stages
    if target.needs_gpu and needs_gpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"backend={target.name} needs a CUDA GPU for {' and '.join(sorted(needs_gpu))} (torch.cuda.is_available() "
                "is False); build on a GPU machine, stop after lower_kv (stages=[export,lower_kv]), or choose backend=xnnpack")
    return plan


def resolve_model(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """The config with the options of ``model.family`` and the settings ``model.checkpoint``
    implies; an override that contradicts either is an error naming both values."""
    from pipeline.models.families import family

    given = {o.lstrip("+").partition("=")[0] for o in overrides}

    def impose(settings: dict, source: str) -> None:
        for key, value in settings.items():
            if f"model.{key}" in given and cfg.model[key] != value:
                raise ConfigError(f"model.{key}={cfg.model[key]} contradicts {source}, which has {key}={value}; "
                                  "drop the override")
        cfg.model.merge_with(settings)

    cfg = copy.deepcopy(cfg)
    if cfg.model.checkpoint:
        from pipeline.models.loaders import checkpoint_config

        name, implied = checkpoint_config(cfg.model.checkpoint)
        impose({"family": name, **implied}, f"model.checkpoint={cfg.model.checkpoint}")
    impose(family(cfg.model.family).options, f"model.family={cfg.model.family}")
    if cfg.draft.name != "none" and cfg.draft.checkpoint:
        from pipeline.models.loaders.dflash import read_config

        implied = read_config(cfg.draft.checkpoint)
        source = f"draft.checkpoint={cfg.draft.checkpoint}"
        for key, want in (("hidden_size", cfg.model.dim), ("vocab_size", cfg.model.vocab_size)):
            got = implied.pop(key)
            if got != want:
                setting = "model.dim" if key == "hidden_size" else "model.vocab_size"
                raise ConfigError(f"{source} has {key}={got}, but the target has {setting}={want}: the draft shares the "
                                  "target's embeddings and head; choose a draft trained for this target")
        for key, value in implied.items():
            if f"draft.{key}" in given and cfg.draft[key] != value:
                raise ConfigError(f"draft.{key}={cfg.draft[key]} contradicts {source}, which has {key}={value}; "
                                  "drop the override")
        cfg.draft.merge_with(implied)
    return cfg


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for package in ("torch", "executorch", "triton", "hydra-core"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SRC, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", str(SRC)], cwd=SRC, capture_output=True, text=True).stdout
        return rev + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(SRC.rglob("*.py")):
        digest.update(str(path.relative_to(SRC)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_key(cfg: DictConfig) -> dict:
    """What decides the artifact: the resolved config (minus where it goes), sources, tools."""
    what = OmegaConf.to_container(cfg, resolve=True)
    for key in ("output_root", "force", "verbose", "dry_run", "rebuild"):
        what.pop(key, None)
    config_hash = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
    key = {"config_hash": config_hash, "source_hash": _source_hash(), "tools": _tool_versions()}
    if cfg.model.checkpoint:
        from pipeline.models.loaders import content_hash

        key["checkpoint_sha256"] = content_hash(cfg.model.checkpoint)
    return key


def _existing(exp_dir: Path, key: dict) -> Path | None:
    for version in sorted(exp_dir.glob("v[0-9]*"), reverse=True):
        try:
            record = json.loads((version / "build.json").read_text())
        except (OSError, ValueError):
            continue
        if all(record.get(k) == v for k, v in key.items()):
            return version
    return None


def _publish(work: Path, exp_dir: Path) -> Path:
    """Rename the finished work dir to the next free version; never overwrite one."""
    while True:
        numbers = [int(p.name[1:]) for p in exp_dir.glob("v[0-9]*") if p.name[1:].isdigit()]
        target = exp_dir / f"v{max(numbers, default=0) + 1:04d}"
        try:
            os.rename(work, target)  # fails if target exists: another build took the number
            return target
        except OSError:
            if target.exists():
                continue
            raise


def build(cfg: DictConfig, overrides: list[str] | None = None, hydra_cfg: DictConfig | None = None,
          exp_dir: Path | None = None, reproduces: Path | None = None) -> Path | None:
    """Check ``cfg``, run its stages and publish the next version of ``exp_dir`` (default
    ``<output_root>/<experiment_name>``); an identical existing version is reused. ``dry_run``: print
    the plan and return None. ``reproduces``: the version this build rebuilds (``rebuild``)."""
    cfg = resolve_model(cfg, overrides or [])
    plan = check_config(cfg)
    exp_dir = exp_dir or Path(cfg.output_root) / cfg.experiment_name
    key = build_key(cfg)
    if cfg.dry_run:
        print_plan(cfg, plan, exp_dir, None if cfg.force or not exp_dir.is_dir() else _existing(exp_dir, key))
        return None
    if exp_dir.is_dir():
        remove_debris(exp_dir)
    if not cfg.force and (existing := _existing(exp_dir, key)):
        print(f"up to date: {existing} was built from the same config, sources and tools (force=true rebuilds)")
        return existing

    exp_dir.mkdir(parents=True, exist_ok=True)
    with _WorkDir(exp_dir) as work:
        try:
            record = _run_stages(cfg, plan, work, key, overrides or [], hydra_cfg)
            if reproduces is not None:
                record["reproduction"] = compare_programs(reproduces, record)
                (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
        except BaseException:
            failed = exp_dir / ".failed" / f"{time.strftime('%Y%m%d-%H%M%S')}-{work.name.removeprefix(BUILDING)}"
            failed.parent.mkdir(exist_ok=True)
            shutil.move(str(work), failed)
            print(f"build failed; partial outputs kept for inspection in {failed} (not a version)")
            raise
        version = _publish(work, exp_dir)
    _summary(version, record)
    return version


BUILDING = ".building-"  # a build in progress: .building-<id>/ and its lock file .building-<id>.lock


class _WorkDir:
    """``.building-<id>/`` for one build, owned through an exclusive lock on ``.building-<id>.lock``.

    The kernel drops the lock when the process dies, however it dies (an error, SIGKILL, the
    out-of-memory killer), so a later build can tell a live build's directory from debris. The
    lock file appears already locked (locked under a temporary name, then renamed)."""

    def __init__(self, exp_dir: Path):
        self.id = uuid.uuid4().hex[:8]
        self.path = exp_dir / f"{BUILDING}{self.id}"
        self.lock_path = exp_dir / f"{BUILDING}{self.id}.lock"

    def __enter__(self) -> Path:
        pending = self.lock_path.with_name(f".pending-{self.id}.lock")
        self._lock = open(pending, "x")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock.write(json.dumps({"pid": os.getpid(), "host": platform.node(),
                                     "started": time.strftime("%Y-%m-%d %H:%M:%S")}))
        self._lock.flush()
        os.rename(pending, self.lock_path)
        self.path.mkdir()
        return self.path

    def __exit__(self, *exc) -> None:
        self.lock_path.unlink(missing_ok=True)
        self._lock.close()


def remove_debris(exp_dir: Path) -> list[Path]:
    """Remove what builds that died left in ``exp_dir`` (their lock is free): say what and whose."""
    removed = []
    for lock_path in sorted([*exp_dir.glob(f"{BUILDING}*.lock"), *exp_dir.glob(".pending-*.lock")]):
        with open(lock_path) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live build holds it
            owner = lock.read().strip()
            work = lock_path.with_suffix("")
            if work.exists():
                shutil.rmtree(work)
                removed.append(work)
                print(f"removed {work}: left by a build that died ({owner or 'owner unknown'}); not a version")
            lock_path.unlink(missing_ok=True)
    for work in sorted(exp_dir.glob(f"{BUILDING}*")):
        # a live build creates its lock before its directory: a directory without one is debris
        if work.is_dir() and not work.with_name(work.name + ".lock").exists():
            shutil.rmtree(work)
            removed.append(work)
            print(f"removed {work}: left by a build that died (no lock); not a version")
    return removed


def _run_stages(cfg, plan, work: Path, key: dict, overrides: list[str], hydra_cfg) -> dict:
    (work / ".hydra").mkdir()
    OmegaConf.save(cfg, work / ".hydra" / "config.yaml", resolve=True)
    (work / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
    if hydra_cfg is not None:
        OmegaConf.save(hydra_cfg, work / ".hydra" / "hydra.yaml")
    artifacts: dict = {}
    timings = {}
    for i, stage in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {stage.name}", flush=True)
        start = time.perf_counter()
        inputs = {name: artifacts[name] for name in (*stage.needs, *stage.optional) if name in artifacts}
        with _heartbeat(stage.name):
            outputs = stage.load()(*(cfg[s] for s in stage.sections), inputs, work)
        timings[stage.name] = round(time.perf_counter() - start, 3)
        print(f"      {stage.name} done in {timings[stage.name]:.1f} s", flush=True)
        artifacts.update(outputs)
    record = {
        **key,
        "experiment": cfg.experiment_name,
        "stages": [s.name for s in plan],
        "stage_seconds": timings,
        "total_seconds": round(sum(timings.values()), 3),
        "git_revision": _git_revision(),
        "inputs": _input_hashes(artifacts),
        "artifacts": {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
                      for p in sorted(work.iterdir()) if p.is_file()},
    }
    # one section per model of the artifact: its weights and, once lowered, its KV stores
    models = {name: {"weights_sha256": digest} for name, digest in record["inputs"].items()}
    for name, kv in artifacts.get("kv_sections", {}).items():
        models.setdefault(name, {}).update(layout=kv["layout"], causal=kv["causal"],
                                           kv_bytes_per_layer=kv["kv_bytes_per_layer"], kv_bytes_total=kv["kv_bytes_total"])
    record["models"] = models
    if "kv_sections" in artifacts:
        record["kv_bytes_total"] = sum(m.get("kv_bytes_total", 0) for m in models.values())  # vision has no KV
    if "validation" in artifacts:
        record["validation_passed"] = artifacts["validation"]["passed"]
    (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


@contextlib.contextmanager
def _heartbeat(name: str, every: float = 60.0):
    """A line every ``every`` seconds while a stage runs: a real model's compile takes minutes
    inside ExecuTorch with nothing else to say."""
    stop, start = threading.Event(), time.perf_counter()

    def beat():
        while not stop.wait(every):
            print(f"      {name}: still running, {time.perf_counter() - start:.0f} s", flush=True)

    thread = threading.Thread(target=beat, name=f"heartbeat-{name}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _input_hashes(artifacts: dict) -> dict:
    """sha256 of each eager model's weights, by model name."""
    from pipeline.runtime.aoti import tensor_bytes

    hashes = {}
    for name, key in (("target", "model"), ("draft", "draft"), ("vision", "vision")):
        if artifacts.get(key) is None:
            continue
        digest = hashlib.sha256()
        for tensor_name, tensor in sorted(artifacts[key].state_dict().items()):
            digest.update(tensor_name.encode())
            digest.update(tensor_bytes(tensor))
        hashes[name] = digest.hexdigest()
    return hashes


def _summary(version: Path, record: dict) -> None:
    print(f"built {version} in {record['total_seconds']:.1f} s")
    for name, info in record["artifacts"].items():
        if name.endswith((".pte", ".ptd")):
            print(f"  {name}: {info['bytes'] / 1e6:.2f} MB")
    if "validation_passed" in record:
        report = json.loads((version / "validation.json").read_text())
        print(f"  validation: {'PASSED' if report['passed'] else 'FAILED'} "
              f"(max relative error {report['max_relative_error']:.2e}, tolerance {report['tolerance']:.0e})")
    else:
        print("  validation: not run (no validate stage)")
