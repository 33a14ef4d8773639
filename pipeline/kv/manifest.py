"""The KV manifest: what a runtime needs to drive an artifact, and nothing else.

Its facts are also published as constant methods of the program
(``constant_methods``) so that a runtime holding only the .pte agrees with it.
"""

from pipeline.kv.layouts import KVLayout

SCHEMA_VERSION = 1


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


def constant_methods(layout: KVLayout, vocab_size: int) -> dict[str, int]:
    """A sequence count marks the sequence paths; a cell artifact declares its pool instead."""
    constants = {
        "get_vocab_size": vocab_size,
        "get_offgraph_kv_max_segments": layout.max_segments,
        "get_offgraph_kv_causal": int(layout.causal),
        "get_max_step_tokens": layout.max_step_tokens,
    }
    return constants | layout.constants()


def manifest(kv: dict, backend: str, program: str, data_files: list[str], methods: dict[str, list[str]],
             tokenizer: str | None = None) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "program": program,
        "data_files": data_files,
        "tokenizer": tokenizer,  # directory of the checkpoint's tokenizer (transformers' format), or null
        "backend": backend,
        "methods": methods,  # method -> its input names in order
        "target": kv,
    }
