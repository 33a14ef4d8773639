"""The runner: resolves the config into its plan, runs each stage or takes it from the stage cache, and
records the build.

Each stage's result is looked up in the stage cache (``pipeline/cache/``) under a key of what
decides it; a stage whose key is there is not run, and the run says per stage ``cached`` or
``building`` and why (what changed since the experiment's last version). The version directory
(``pipeline/build/versions.py``) gets the entries' files, linked, and ``build.json``; a version built from
the same entries is reused whole.
"""

import contextlib
import json
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.build.dry_run import print_plan
from pipeline.build.plan import BuildPlan, resolve, resolve_model
from pipeline.build.versions import BUILDING, WorkDir, compare_programs, existing, publish, remove_debris, sha256_file, versions
from pipeline.cache import Cache, LazyArtifacts, changes, stage_keys, tool_versions
from pipeline.cache.store import files_under
from pipeline.errors import ConfigError

SRC = Path(__file__).resolve().parents[1]  # the pipeline package (build.json's git revision: dirty when it is)


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    try:
        hydra = version("hydra-core")
    except PackageNotFoundError:
        hydra = "not installed"
    return {"python": platform.python_version(), **tool_versions(), "hydra-core": hydra}


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=SRC, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", str(SRC)], cwd=SRC, capture_output=True, text=True).stdout
        return rev + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _forced(cfg: DictConfig, plan: list) -> dict[str, str]:
    """The stages to build whatever the cache holds, and why."""
    names = [s.name for s in plan]
    if cfg.force:
        return dict.fromkeys(names, "force=true")
    if cfg.force_from:
        if cfg.force_from not in names:
            raise ConfigError(f"force_from={cfg.force_from} is not a stage of this build; choose one of {', '.join(names)}")
        return dict.fromkeys(names[names.index(cfg.force_from):], f"force_from={cfg.force_from}")
    return {}


def _why_build(stage: str, key: dict, previous: dict | None, forced: dict, damaged: str | None) -> str:
    if stage in forced:
        return forced[stage]
    if damaged:
        return f"its cache entry {key['digest'][:12]} was damaged ({damaged}), so it is rebuilt"
    if previous is None:
        return "not in the cache"
    if stage not in previous.get("stage_keys", {}):
        return f"not in the cache; {previous['version']} did not run it"
    said = changes(previous["stage_keys"][stage], key["parts"])
    if not said:
        return f"its cache entry (as used by {previous['version']}) is gone"
    return f"changed since {previous['version']}: {'; '.join(said[:4])}{f' and {len(said) - 4} more' if len(said) > 4 else ''}"


def _previous(exp_dir: Path) -> dict | None:
    """The newest version's record, to say what changed since it."""
    for version, record in versions(exp_dir):
        if "stage_keys" in record:
            return record | {"version": version.name}
    return None


def cache_of(cfg: DictConfig) -> Cache:
    return Cache(Path(cfg.cache_dir) if cfg.cache_dir else Path(cfg.output_root) / ".cache")


def build(cfg: DictConfig, overrides: list[str] | None = None, hydra_cfg: DictConfig | None = None,
          exp_dir: Path | None = None, reproduces: Path | None = None) -> Path | None:
    """Check ``cfg``, run its stages (each reused from the stage cache when its key is there) and
    publish the next version of ``exp_dir`` (default ``<output_root>/<experiment_name>``); an existing
    version of the same stage entries is reused. ``dry_run``: print the plan and return None.
    ``reproduces``: the version this build rebuilds (``rebuild``)."""
    build_plan = resolve(resolve_model(cfg, overrides or []))
    cfg = build_plan.config  # kv.capacity and kv.max_step_tokens as derived where null: the keys and the record say them
    plan = list(build_plan.stages)
    forced = _forced(cfg, plan)
    exp_dir = exp_dir or Path(cfg.output_root) / cfg.experiment_name
    keys = stage_keys(cfg, plan)
    cache = cache_of(cfg)
    previous = _previous(exp_dir) if exp_dir.is_dir() else None
    if cfg.dry_run:
        statuses = {}
        for stage in plan:
            key = keys[stage.name]
            entry = None if stage.name in forced else cache.peek(stage.name, key["digest"])
            statuses[stage.name] = (f"cached ({key['digest'][:12]})" if entry else
                                    f"would build: {_why_build(stage.name, key, previous, forced, None)}")
        print_plan(build_plan, exp_dir, statuses)
        return None
    if exp_dir.is_dir():
        remove_debris(exp_dir)
    if not forced and exp_dir.is_dir() and (reused := existing(exp_dir, keys)):
        for i, stage in enumerate(plan, 1):
            print(f"[{i}/{len(plan)}] {stage.name}: cached ({keys[stage.name]['digest'][:12]})")
        print(f"up to date: {reused} was built from the same config, inputs, code and tools (force=true rebuilds)")
        _context(build_plan)
        return reused

    exp_dir.mkdir(parents=True, exist_ok=True)
    with cache.building(), WorkDir(exp_dir) as work:
        try:
            record = _run_stages(build_plan, keys, cache, work, overrides or [], hydra_cfg, previous, forced)
            if reproduces is not None:
                record["reproduction"] = compare_programs(reproduces, record)
                (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
        except BaseException:
            failed = exp_dir / ".failed" / f"{time.strftime('%Y%m%d-%H%M%S')}-{work.name.removeprefix(BUILDING)}"
            failed.parent.mkdir(exist_ok=True)
            shutil.move(str(work), failed)
            print(f"build failed; partial outputs kept for inspection in {failed} (not a version)")
            raise
        version = publish(work, exp_dir)
    _summary(version, record)
    _context(build_plan)
    return version


def _run_stages(build_plan: BuildPlan, keys: dict, cache: Cache, work: Path, overrides: list[str], hydra_cfg,
                previous: dict | None, forced: dict) -> dict:
    """Each stage from its cache entry or built (and stored) under the entry's lock; the version's
    files are the entries' files, linked; ``build.json`` says which stage came from where."""
    cfg, plan = build_plan.config, build_plan.stages
    (work / ".hydra").mkdir()
    OmegaConf.save(cfg, work / ".hydra" / "config.yaml", resolve=True)
    (work / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
    if hydra_cfg is not None:
        OmegaConf.save(hydra_cfg, work / ".hydra" / "hydra.yaml")
    artifacts = LazyArtifacts()
    entries, timings = {}, {}
    for i, stage in enumerate(plan, 1):
        key = keys[stage.name]
        start = time.perf_counter()
        with cache.claim(stage.name, key["digest"]):
            entry, damaged = (None, None) if stage.name in forced else cache.lookup(stage.name, key["digest"])
            if entry is not None:
                how = "cached"
                entry.link_files(work)
                artifacts.add_lazy(stage.gives, _loader(stage.name, entry, work))
                print(f"[{i}/{len(plan)}] {stage.name}: cached ({key['digest'][:12]}, built in {entry.record['seconds']:.1f} s "
                      f"on {entry.record['created']})", flush=True)
            else:
                print(f"[{i}/{len(plan)}] {stage.name}: building ({_why_build(stage.name, key, previous, forced, damaged)})",
                      flush=True)
                before = set(files_under(work))
                with _heartbeat(stage.name):
                    outputs = stage.load()(build_plan, artifacts.view((*stage.needs, *stage.optional)), work)
                seconds = time.perf_counter() - start
                new_files = sorted(set(files_under(work)) - before)  # what the stage wrote
                entry = cache.store(stage.name, key, work, new_files, outputs, _facts(outputs), seconds)
                artifacts.add(outputs)
                how = "built"
                print(f"      {stage.name} built in {seconds:.1f} s", flush=True)
        entries[stage.name] = (entry, how)
        timings[stage.name] = round(time.perf_counter() - start, 3)
    facts = [e.record["facts"] for e, _ in entries.values()]
    record = {
        "experiment": cfg.experiment_name,
        "stages": [s.name for s in plan],
        "stage_seconds": timings,
        "total_seconds": round(sum(timings.values()), 3),
        "stage_entries": {name: {"key": e.key, "from": how, "built_seconds": e.record["seconds"]}
                          for name, (e, how) in entries.items()},
        "cache_dir": str(cache.root),
        "tools": _tool_versions(),
        "git_revision": _git_revision(),
        "inputs": {name: sha for f in facts for name, sha in f.get("weights", {}).items()},
        "artifacts": {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                      for p in sorted(work.iterdir()) if p.is_file()},
        "stage_keys": {name: key["parts"] for name, key in keys.items()},
    }
    # one section per model of the artifact: its weights and, once lowered, its KV stores (the plan's)
    models = {name: {"weights_sha256": digest} for name, digest in record["inputs"].items()}
    lowered = "lower_kv" in entries
    for part in build_plan.attending() if lowered else ():
        kv = part.layout
        models.setdefault(part.name, {}).update(layout=kv.layout, causal=kv.causal, kv_bytes_per_layer=kv.kv_bytes_per_layer(),
                                                kv_bytes_total=sum(kv.kv_bytes_per_layer()))
    record["models"] = models
    if lowered:
        record["kv_bytes_total"] = sum(m.get("kv_bytes_total", 0) for m in models.values())  # vision has no KV
    if quant := [f["quant"] for f in facts if "quant" in f]:
        record["quant"] = quant[0]  # the scheme, the group size, every quantized tensor's error
    if partitions := [f["partitions"] for f in facts if "partitions" in f]:
        record["partitions"] = partitions[0]  # backend delegates per method (compile)
    if passed := [f["validation_passed"] for f in facts if "validation_passed" in f]:
        record["validation_passed"] = passed[0]
    (work / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _loader(stage: str, entry, work: Path):
    def load(name: str):
        print(f"      loading {stage}'s {name} from the cache", flush=True)
        return entry.load_output(name, work)

    return load


@contextlib.contextmanager
def _heartbeat(name: str, every: float = 15.0):
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


def _facts(outputs: dict) -> dict:
    """What build.json says about a stage's results, kept in its entry: the sha256 of each eager
    model's weights (by role), the quantization, the partitions, whether validation passed."""
    from pipeline.models.methods import weights_sha256

    facts: dict = {}
    for key in ("models", "vision_models"):
        for name, module in (outputs.get(key) or {}).items():
            facts.setdefault("weights", {})[name] = weights_sha256(module)
    if "quant" in outputs:
        facts["quant"] = outputs["quant"]
    if "partitions" in outputs:
        facts["partitions"] = outputs["partitions"]
    if "validation" in outputs:
        facts["validation_passed"] = outputs["validation"]["passed"]
    return facts


def _context(build_plan: BuildPlan) -> None:
    """The summary's last lines: the context each sequence gets, and why where it was derived."""
    for line in build_plan.context.lines(build_plan.target.layout):
        print(f"  {line}")


def _summary(version: Path, record: dict) -> None:
    print(f"built {version} in {record['total_seconds']:.1f} s")
    for name, info in record["artifacts"].items():
        if name.endswith((".pte", ".ptd")):
            print(f"  {name}: {info['bytes'] / 1e6:.2f} MB")
    if "validation_passed" in record:
        report = json.loads((version / "validation.json").read_text())
        verdict = "PASSED" if report["passed"] else "FAILED"
        if "quant" in report:  # the quantized measures by name (quant.exactness, quant.quality)
            exact, q = report["quant"]["exactness"]["pte_vs_oracle"], report["quant"]["quality"]
            print(f"  validation: {verdict} (against the quantized eager model: median relative error "
                  f"{exact['median']:.2e}, p90 {exact['p90']:.2e}; against the unquantized model on {q['text']}: mean "
                  f"KLD {q['mean_kld']:.4f}, p99 {q['p99_kld']:.3f}, top-1 {q['top1_agreement']:.1%}, perplexity ratio "
                  f"{q['ppl_ratio']:.3f})")
        else:
            print(f"  validation: {verdict} (max relative error {report['max_relative_error']:.2e}, "
                  f"tolerance {report['tolerance']:.2g})")
    else:
        print("  validation: not run (no validate stage)")
