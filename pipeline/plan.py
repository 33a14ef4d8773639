"""What a build would do, and whether a build reproduced another: ``dry_run=true`` (``print_plan``,
from the config alone) and ``rebuild=<version>`` (``rebuild``, ``compare_programs``)."""

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pipeline.errors import ConfigError


def rebuild(version: Path) -> Path:
    """Build ``version`` again from the config it records (``.hydra/config.yaml``) into the next version
    of its experiment directory; the new ``build.json`` says whether its programs are byte-identical."""
    from pipeline.config import SCHEMA

    recorded = version / ".hydra" / "config.yaml"
    if not recorded.is_file() or not (version / "build.json").is_file():
        raise ConfigError(f"rebuild={version} is not a version directory (it needs .hydra/config.yaml and build.json)")
    cfg = OmegaConf.merge(OmegaConf.structured(SCHEMA), OmegaConf.load(recorded))
    cfg.force, cfg.force_from, cfg.rebuild, cfg.dry_run = True, None, None, False  # every stage built again, none from the cache
    print(f"rebuilding {version} from {recorded}")
    from pipeline.runner import build

    new = build(cfg, [], exp_dir=version.parent, reproduces=version)
    result = json.loads((new / "build.json").read_text())["reproduction"]
    print(f"  reproduction of {version}: {'byte-identical' if result['identical'] else 'DIFFERS'} "
          f"({', '.join(f'{n} {s}' for n, s in result['artifacts'].items())})")
    return new


def compare_programs(original: Path, record: dict) -> dict:
    """The programs of this build against those ``original`` recorded: the same bytes (sha256)?"""
    theirs = json.loads((original / "build.json").read_text())["artifacts"]
    programs = [name for name in record["artifacts"] if name.endswith((".pte", ".ptd"))]
    same = {name: "identical" if theirs.get(name, {}).get("sha256") == record["artifacts"][name]["sha256"] else "differs"
            for name in programs}
    return {"of": str(original), "artifacts": same, "identical": bool(same) and all(s == "identical" for s in same.values())}


def print_plan(cfg: DictConfig, plan: list, exp_dir: Path, statuses: dict[str, str]) -> None:
    """``dry_run=true``: what the build would do (``statuses``: per stage, cached or why it would be
    built) and what the artifact holds, from the config alone (checked as a build is; nothing
    exported, nothing written)."""
    from pipeline.feasibility import GB, machine_memory, memory_estimate
    from pipeline.kv.layouts import DTYPE_BYTES, model_layouts
    from pipeline.models.args import draft_args, model_args, vision_args

    target = model_args(cfg.model)
    draft = draft_args(cfg.draft, target) if cfg.draft.name != "none" else None
    layouts = model_layouts(cfg.kv, target, cfg.model.causal, draft)
    models = {"target": (cfg.model.name, target), "draft": (cfg.draft.name, draft),
              "vision": (cfg.vision.name, vision_args(cfg.vision, target) if cfg.vision.name != "none" else None)}
    print(f"dry run: {exp_dir} (nothing is built or written)")
    for i, stage in enumerate(plan, 1):
        print(f"  [{i}/{len(plan)}] {stage.name}: {statuses[stage.name]}")
    item = DTYPE_BYTES[cfg.model.dtype]
    for name, (preset, args) in models.items():
        if args is None:
            continue
        line = f"  {name:<7}{preset}: {args.n_parameters() / 1e6:.2f} M weights, {args.n_parameters() * item / 1e6:.2f} MB ({cfg.model.dtype})"
        if name in layouts:
            layout = layouts[name]
            kv = sum(layout.kv_bytes_per_layer())
            line += (f"; KV {layout.layout}, max_seqs={layout.max_seqs}, {'causal' if layout.causal else 'non-causal'}: "
                     f"{kv} bytes ({kv / 1e6:.2f} MB) over {len(layout.layers)} layers")
        print(line)
    if cfg.quant.scheme != "none":
        from pipeline.quant import describe

        print(f"  quant  {cfg.quant.scheme}: the target's {describe(cfg.quant)}")
    estimate = memory_estimate(layouts, target, cfg.model.dtype)
    budget = cfg.memory_budget_gb * GB if cfg.memory_budget_gb is not None else machine_memory()
    print(f"  build peak memory: an estimated {estimate['peak'] / GB:.2f} GB of a {budget / GB:.1f} GB budget")
