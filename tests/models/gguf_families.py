"""Tiny random transformers models of each family, and GGUF files of them as llama.cpp's
``convert_hf_to_gguf.py`` writes them, with ``gguf.GGUFWriter``.

Written from the converter's documented behaviour (its tensor names come from the ``gguf`` package's own
name map; its metadata and tensor transforms, per architecture, are listed below), not from its code:

- every architecture: ``{arch}.block_count``, ``.context_length``, ``.embedding_length``,
  ``.feed_forward_length``, ``.attention.head_count``/``head_count_kv``, ``.attention.layer_norm_rms_epsilon``,
  ``.rope.freq_base`` (the full-attention layers' theta), ``.attention.key_length``/``value_length`` when
  the config has ``head_dim``, ``.rope.freq_base_swa`` when its rope parameters have a
  ``sliding_attention`` theta; RoPE scaling ``linear`` (``.rope.scaling.type``, ``.factor``), ``yarn``
  (+ ``.original_context_length``, the betas when given), ``longrope`` (the type only); 1-D tensors and
  norms stay F32, matrices take the file's type (Q8_0 falls back to F16 where a row is not whole blocks);
  a tied head is not written.
- ``llama`` (Llama, Mistral) and ``smollm3`` (Llama's converter): ``.vocab_size``,
  ``.rope.dimension_count`` = head_dim; the rows of q and k permuted so that RoPE pairs are adjacent
  (per head: [2, pairs] -> [pairs, 2]); ``rope_type`` llama3 written as the tensor ``rope_freqs.weight``
  (a divisor per frequency, F32) and no scaling keys, its original context read from the config's top
  level (8192 when absent there). Mistral is written as architecture ``llama``; its ``general.name``
  says Mistral. llama.cpp runs smollm3 with no RoPE on layers (i + 1) % 4 == 0: no key says so.
- ``gemma3``: every ``*norm.weight`` stored plus one (Gemma's ``(1 + w)`` RMSNorm), the sliding window
  (``.attention.sliding_window``); llama.cpp itself fixes the 5:1 pattern and the local base 10000 when
  the file does not say them.
- ``phi3``: its own keys (no generic ones): ``.rope.dimension_count`` = int(partial_rotary_factor * dim)
  // heads, ``.rope.scaling.original_context_length``, ``.attention.sliding_window`` (0 for none); fused
  ``attn_qkv`` and ``ffn_up`` (gate then up) as the checkpoint has them; longrope written as the tensors
  ``rope_factors_short.weight`` / ``rope_factors_long.weight`` and ``.rope.scaling.attn_factor`` =
  sqrt(1 + ln(max / original context) / ln(original context)).
- ``qwen2`` / ``qwen3``: the generic keys only. llama.cpp's converter drops Qwen2's use_sliding_window;
  this one writes it in the keys llama.cpp defines for windows (``.attention.sliding_window`` and
  ``.attention.sliding_window_pattern``, per layer true = sliding), so that reading them is tested
  (``window_keys=False`` writes what llama.cpp writes).

A minimal tokenizer (``tokenizer.ggml.model`` gpt2, one token per id) is written: transformers' GGUF
loading needs none to load the model, but real files have one and non-llama converters write no
``.vocab_size``, so the vocabulary size is the token count.
"""

import math
from pathlib import Path

import numpy as np
import torch
import transformers

from conftest import gguf_metadata

VOCAB = 320
# initializer_range 0.1 (not 0.02): attention then moves the logits enough that a misread RoPE or q/k shows
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, initializer_range=0.1)

# each family's tiny model with the features of its real checkpoints
CONFIGS = {
    # Llama 3.2: llama3 RoPE scaling (factor 32, original context 8192), theta 500000, tied head; head_dim 16 puts
    # one frequency in the blended band, the lowest three divided by the factor
    "llama": lambda: transformers.LlamaConfig(
        **TINY, num_hidden_layers=2, head_dim=16, max_position_embeddings=131072, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Mistral 7B v0.3: no sliding window (null), its own head
    "mistral": lambda: transformers.MistralConfig(
        **TINY, num_hidden_layers=2, head_dim=16, max_position_embeddings=256, sliding_window=None,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen2.5 with use_sliding_window on (the layers from max_window_layers slide) and its YaRN (factor 4)
    "qwen2": lambda: transformers.Qwen2Config(
        **TINY, num_hidden_layers=3, max_position_embeddings=128, use_sliding_window=True, sliding_window=8,
        max_window_layers=1, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}),
    # Qwen3: q/k norms, a head dim of its own
    "qwen3": lambda: transformers.Qwen3Config(
        **TINY, num_hidden_layers=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Gemma 3 (4B-like, text): 5 local : 1 global layers, local theta 10000 unscaled, global 1e6 with linear
    # scaling 8, query_pre_attn_scalar = head_dim (llama.cpp's scale for every size but 27B), tied head
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, initializer_range=0.1, query_pre_attn_scalar=32, sliding_window=8, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}),
    # Phi-4-mini: partial rotary 0.75, longrope (max 4 x the original context), tied head, no window
    "phi3": lambda: transformers.Phi3Config(
        **TINY, num_hidden_layers=2, max_position_embeddings=128, original_max_position_embeddings=32,
        tie_word_embeddings=True, sliding_window=None, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
                         "long_factor": [1.0, 1.5, 2.5, 4.0, 6.5, 9.0]}),
    # SmolLM3: no RoPE on every 4th layer (no_rope_layer_interval 4), theta 5e6, tied head
    "smollm3": lambda: transformers.SmolLM3Config(
        **TINY, num_hidden_layers=4, max_position_embeddings=256, no_rope_layer_interval=4, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}),
}
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
           "smollm3": "SmolLM3ForCausalLM"}
# the GGUF architecture llama.cpp writes each as
ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3",
         "smollm3": "smollm3"}
PERMUTED = ("llama", "mistral", "smollm3")  # llama.cpp's Llama converter (and SmolLM3's, its subclass) permutes q and k
TYPES = ("F32", "F16", "Q8_0")


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's tiny model, random, with its norms and biases moved off their initial values (so a
    dropped or misread one shows)."""
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[family])(CONFIGS[family]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _stored_type(name: str, values: np.ndarray, ftype: str):
    """The tensor type llama.cpp's converter stores a tensor in: 1-D tensors and norms F32, matrices the
    file's type (Q8_0 -> F16 where a row is not whole blocks of 32)."""
    import gguf

    if values.ndim <= 1 or name.endswith("_norm.weight"):
        return gguf.GGMLQuantizationType.F32
    if ftype == "Q8_0" and values.shape[-1] % 32:
        return gguf.GGMLQuantizationType.F16
    return gguf.GGMLQuantizationType[ftype]


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Halves -> adjacent pairs: rows [head, 2, pairs] -> [head, pairs, 2]."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(rope: dict, head_dim: int, original_context: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for a llama3 ``rope_type``: per frequency, the divisor of the base frequency,
    taken from transformers' own llama3 frequencies (the oracle, not our ``models/rope.py``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**rope, "rope_type": "llama3", "original_max_position_embeddings": original_context}
    config = transformers.LlamaConfig(hidden_size=head_dim, num_attention_heads=1, head_dim=head_dim,
                                      rope_parameters=params)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return (base / scaled).numpy().astype(np.float32)


def write_gguf(model, family: str, path: Path, ftype: str = "F32", *, norm_shift: bool = True, window_keys: bool = True,
               skip: tuple[str, ...] = (), extra: dict | None = None, tokenizer: bool = True) -> Path:
    """``model`` (a ``tiny_model``) as llama.cpp's converter writes it, tensors in ``ftype`` (F32, F16,
    Q8_0). For the tests that must fail: ``norm_shift=False`` leaves Gemma's norms unshifted, ``skip``
    leaves tensors out (GGUF names), ``extra`` adds metadata {key: value} (floats as float32).
    ``tokenizer=False``: no tokenizer metadata (the placeholder vocabulary transformers' loader needs is not
    a tokenizer an artifact can carry)."""
    import gguf

    c, arch = model.config, ARCHS[family]
    rope = dict(c.rope_parameters)
    full = rope.get("full_attention", rope)
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("Mistral tiny" if family == "mistral" else f"tiny {family}")
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[ftype])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(full["rope_theta"])
    extra_tensors = {}
    if family == "phi3":
        original = c.original_max_position_embeddings
        rope_dims = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // heads
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            extra_tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            extra_tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    else:
        if getattr(c, "head_dim", None) is not None:
            w.add_key_length(c.head_dim)
            w.add_value_length(c.head_dim)
        kind = full.get("rope_type", "default")
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        elif kind == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(full["factor"])
            w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
            if full.get("beta_fast") is not None:
                w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
            if full.get("beta_slow") is not None:
                w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
        elif kind == "llama3":  # a tensor, no keys; the converter reads the original context from the top level
            extra_tensors["rope_freqs.weight"] = llama3_factors(
                full, head_dim, c.to_dict().get("original_max_position_embeddings", 8192))
        if "sliding_attention" in rope:
            w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if family in ("llama", "mistral", "smollm3"):
        w.add_vocab_size(c.vocab_size)
        w.add_rope_dimension_count(head_dim)
    if family == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if family == "qwen2" and c.use_sliding_window and window_keys:
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([kind == "sliding_attention" for kind in c.layer_types])
    gguf_metadata(w, extra or {})
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
        w.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(stem)}.{suffix}"
        values = tensor.float().numpy()
        if family in PERMUTED and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _permute(values, heads if "q_proj" in hf_name else kv_heads)
        if family == "gemma3" and norm_shift and hf_name.endswith("norm.weight"):
            values = values + 1
        extra_tensors[name] = values
    for name, values in extra_tensors.items():
        if name in skip:
            continue
        kind = _stored_type(name, values, ftype)
        data = gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), kind)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rounded(model, ftype: str) -> torch.nn.Module:
    """``model`` with every weight rounded as ``write_gguf`` stores it in ``ftype`` (quantized and
    dequantized by the gguf package; 1-D tensors and norms kept): the reference a file of that type must
    equal. Rounding is per row, so it commutes with the q/k row permutation."""
    import copy

    import gguf

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            values = p.float().numpy()
            kind = _stored_type("x_norm.weight" if "norm" in name else name, values, ftype)
            if kind != gguf.GGMLQuantizationType.F32:
                data = gguf.quants.quantize(np.ascontiguousarray(values), kind)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(data, kind).reshape(values.shape).astype(np.float32)))
    return out
