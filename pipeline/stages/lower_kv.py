"""lower_kv: LowerOffGraphKVPass on every method that attends; the KV manifest.

needs: model, exported    gives: layout, lowered ({method: ExportedProgram}), kv_manifest
"""

from pipeline.backends import backend
from pipeline.kv.layouts import build_layout
from pipeline.kv.manifest import kv_section
from pipeline.passes.lower_offgraph_kv import count_neutral, lower_offgraph_kv


def run(kv_cfg, backend_cfg, inputs: dict, workdir) -> dict:
    layout = build_layout(kv_cfg, inputs["model"].args)
    kernel = backend(backend_cfg.name).attention_kernel()
    lowered = {}
    for name, (ep, spec) in inputs["exported"].items():
        if count_neutral(ep) == 0:
            lowered[name] = ep  # embed_text reads no cache
            continue
        print(f"  lower {name}: {count_neutral(ep)} update_and_attend -> {layout.layout} store + attention", flush=True)
        lowered[name] = lower_offgraph_kv(ep, layout, spec, kernel)
    return {"layout": layout, "lowered": lowered, "kv_manifest": kv_section(layout, inputs["model"].args.vocab_size)}
