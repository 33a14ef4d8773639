"""The KV manifest: what a runtime needs to drive an artifact, and nothing else.

Its facts are also published as constant methods of the program
(``constant_methods``) so that a runtime holding only the .pte agrees with it.
"""

from pipeline.kv.layouts import KVLayout

# the step methods, by the model they run (embed_text embeds the target's tokens)
EMBED = "embed_text"
TARGET_STEP = "target_forward_from_embeddings"
DRAFT_STEP = "draft_forward"
VISION = "vision_encoder"
MODELS = ("target", "draft", "vision")  # the manifest's model sections, in this order

SCHEMA_VERSION = 2  # 2: a section per model (target, draft), step_width


def kv_section(layout: KVLayout, vocab_size: int) -> dict:
    return {
        "layout": layout.layout,
        "vocab_size": vocab_size,  # token ids a step takes: [0, vocab_size)
        "max_seqs": layout.max_seqs,
        "max_seq_len": layout.max_seq_len,
        "max_segments": layout.max_segments,
        "causal": layout.causal,
        "columns": layout.columns,
        "capacity": layout.capacity,
        "max_step_tokens": layout.max_step_tokens,
        "step_width": layout.step_width,
        "dtype": layout.dtype,
        "n_kv_heads": layout.n_kv_heads,
        "head_dim": layout.head_dim,
        "layers": [
            {"kind": layer.kind, "rows": layer.rows, "window": layer.window, "store_shape": list(layout.store_shape(layer))}
            for layer in layout.layers
        ],
        "step_buffers": [{"name": b.name, "shape": list(b.shape), "dtype": b.dtype} for b in layout.step_buffers()],
        "kv_bytes_per_layer": layout.kv_bytes_per_layer(),
        "kv_bytes_total": sum(layout.kv_bytes_per_layer()),
    }


def constant_methods(sections: dict[str, dict]) -> dict[str, object]:
    """The program's constant methods from the manifest's model sections. A sequence count marks the
    sequence paths; a cell artifact declares its pool instead. A draft's KV constants carry a
    ``draft_`` prefix (``get_draft_offgraph_kv_max_seqs``), its block facts Muse Glimmer's names."""
    from pipeline.kv.layouts import layout_from_manifest

    kv = sections["target"]
    layout = layout_from_manifest(kv)
    constants = {
        "get_vocab_size": kv["vocab_size"],
        "get_offgraph_kv_max_segments": layout.max_segments,
        "get_offgraph_kv_causal": int(layout.causal),
        "get_max_step_tokens": layout.max_step_tokens,
    } | layout.constants()
    if "draft" in sections:
        draft = sections["draft"]
        constants |= {f"get_draft_{name.removeprefix('get_')}": value
                      for name, value in layout_from_manifest(draft).constants().items()}
        constants |= {"get_draft_offgraph_kv_causal": int(draft["causal"]), "get_block_size": draft["block_size"],
                      "get_mask_token_id": draft["mask_token_id"], "get_n_target_layers": len(draft["target_layer_ids"]),
                      "get_target_layer_ids": list(draft["target_layer_ids"])}
    if "vision" in sections:
        vision = sections["vision"]
        constants |= {"has_vision_encoder": 1, "get_max_image_tokens": vision["n_image_tokens"],
                      "get_image_size": vision["image_size"], "get_image_token_id": vision["image_token_id"],
                      "get_vision_hidden_size": vision["out_dim"]}
    return constants


def manifest(sections: dict[str, dict], backend: str, program: str, data_files: list[str],
             methods: dict[str, list[str]], tokenizer: str | None = None) -> dict:
    """``sections``: each model's section (``target``; ``draft`` and ``vision`` when the artifact has them)."""
    return {
        "schema_version": SCHEMA_VERSION,
        "program": program,
        "data_files": data_files,
        "tokenizer": tokenizer,  # directory of the checkpoint's tokenizer (transformers' format), or null
        "backend": backend,
        "methods": methods,  # method -> its input names in order
        **sections,
    }
