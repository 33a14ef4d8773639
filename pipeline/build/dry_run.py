"""``dry_run=true``: what a build would do, from its plan alone (nothing exported, nothing written)."""

from pathlib import Path

from pipeline.build.feasibility import GB, machine_memory, memory_estimate
from pipeline.build.plan import BuildPlan
from pipeline.kv.layouts import DTYPE_BYTES


def print_plan(plan: BuildPlan, exp_dir: Path, statuses: dict[str, str]) -> None:
    """Each stage (``statuses``: cached or why it would be built) and what the artifact holds: each
    model's weights and KV stores, the context each sequence gets (and why, where derived), the
    quantization and the build's estimated peak memory."""
    cfg = plan.config
    print(f"dry run: {exp_dir} (nothing is built or written)")
    for i, stage in enumerate(plan.stages, 1):
        print(f"  [{i}/{len(plan.stages)}] {stage.name}: {statuses[stage.name]}")
    item = DTYPE_BYTES[cfg.model.dtype]
    for name, part in plan.parts.items():
        n = part.args.n_parameters()
        line = f"  {name:<7}{part.role.preset(cfg)}: {n / 1e6:.2f} M weights, {n * item / 1e6:.2f} MB ({cfg.model.dtype})"
        if (layout := part.layout) is not None:
            kv = sum(layout.kv_bytes_per_layer())
            line += (f"; KV {layout.layout}, max_seqs={layout.max_seqs}, {'causal' if layout.causal else 'non-causal'}: "
                     f"{kv} bytes ({kv / 1e6:.2f} MB) over {len(layout.layers)} layers")
        print(line)
    for line in plan.context.lines(plan.target.layout):
        print(f"  {line}")
    if plan.quant.quantized:
        draft = " (and the draft's linears)" if cfg.quant.draft else ""
        print(f"  quant  {plan.quant.name}: the target's{draft} {plan.quant.describe(cfg.quant)}")
    estimate = plan.memory or memory_estimate([p.layout for p in plan.attending()], plan.target.args, cfg.model.dtype)
    budget = cfg.memory_budget_gb * GB if cfg.memory_budget_gb is not None else machine_memory()
    print(f"  build peak memory: an estimated {estimate['peak'] / GB:.2f} GB of a {budget / GB:.1f} GB budget")
