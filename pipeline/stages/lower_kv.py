"""lower_kv: LowerOffGraphKVPass on every method that attends; the KV manifest.

needs: model, exported    gives: layout, lowered ({method: ExportedProgram}), kv_manifest
"""

import torch

from pipeline.kv.layouts import build_layout
from pipeline.kv.manifest import kv_section
from pipeline.passes.lower_offgraph_kv import count_neutral, lower_offgraph_kv


def attention_kernel(backend: str) -> dict:
    """The sdpa_varlen implementation the backend runs: on CUDA the Triton kernel, planned once
    per step and layer kind; ATen on CPU backends."""
    if backend == "cuda":
        from pipeline.kernels import sdpa_varlen  # noqa: F401  (registers the Triton ops)

        return {"sdpa_varlen": torch.ops.kvcache.sdpa_varlen_attend.default,
                "sdpa_plan": torch.ops.kvcache.sdpa_varlen_plan.default}
    return {"sdpa_varlen": torch.ops.kvcache.sdpa_varlen.default}


def run(kv_cfg, backend_cfg, inputs: dict, workdir) -> dict:
    layout = build_layout(kv_cfg, inputs["model"].args)
    kernel = attention_kernel(backend_cfg.name)
    lowered = {}
    for name, (ep, spec) in inputs["exported"].items():
        if count_neutral(ep) == 0:
            lowered[name] = ep  # embed_text reads no cache
            continue
        print(f"  lower {name}: {count_neutral(ep)} update_and_attend -> {layout.layout} store + attention", flush=True)
        lowered[name] = lower_offgraph_kv(ep, layout, spec, **kernel)
    return {"layout": layout, "lowered": lowered, "kv_manifest": kv_section(layout, inputs["model"].args.vocab_size)}
