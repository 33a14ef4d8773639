"""lower_kv: LowerOffGraphKVPass on every method that attends, each over its model's layout; the KV
sections of the manifest. Every method is exported again here with the bounds of the layout
(``method_inputs``: the widest step, the sampler's rows), the export stage's being the layout's none.

needs: model, draft, exported    gives: layouts ({model: KVLayout}), lowered ({method: ExportedProgram}),
                                        kv_sections ({model: manifest section})
"""

import torch

from pipeline.backends import backend
from pipeline.kv.layouts import model_layouts
from pipeline.kv.manifest import kv_section
from pipeline.passes.lower_offgraph_kv import count_neutral, lower_offgraph_kv, unlifted
from pipeline.stages.export import method_inputs


def run(model_cfg, kv_cfg, backend_cfg, inputs: dict, workdir) -> dict:
    target, draft = inputs["model"], inputs["draft"]
    layouts = model_layouts(kv_cfg, target.args, model_cfg.causal, draft.args if draft else None)
    kernel = backend(backend_cfg.name).attention_kernel()
    widths = {name: layout.step_width for name, layout in layouts.items()}
    specs = method_inputs(target.args, widths, kv_cfg.max_seqs, getattr(torch, model_cfg.dtype), draft.args if draft else None)
    lowered = {}
    for name, ep in inputs["exported"].items():
        spec = specs[name]
        if count_neutral(ep) == 0:  # embed_text reads no cache: only the layout's bounds
            with torch.no_grad():
                lowered[name] = torch.export.export(unlifted(ep), spec.args, dynamic_shapes=spec.dynamic_shapes, strict=False)
            continue
        layout = layouts[spec.model]
        print(f"  lower {name}: {count_neutral(ep)} update_and_attend -> {spec.model} {layout.layout} store + attention",
              flush=True)
        lowered[name] = lower_offgraph_kv(ep, layout, spec, kernel)
    sections = {"target": kv_section(layouts["target"], target.args.vocab_size)}
    if draft is not None:
        a = draft.args
        sections["draft"] = kv_section(layouts["draft"], target.args.vocab_size) | {
            "block_size": a.block_size, "mask_token_id": a.mask_token_id,
            "target_layer_ids": list(a.target_layer_ids), "feature_dim": a.feature_dim,
            "feature_dtype": model_cfg.dtype}
    return {"layouts": layouts, "lowered": lowered, "kv_sections": sections}

