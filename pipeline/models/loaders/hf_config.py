"""A Hugging Face ``config.json`` as our decoder's settings, by the field names ``transformers`` uses.

Every field is either read (``READ``), known not to change the forward pass at inference (``INERT``),
or refused, naming it: a field silently dropped is a model silently wrong. Values our decoder cannot
compute (another activation, biases on the MLP, attention soft-capping, a RoPE type not in
``models/rope.py``) are refused naming the field and what is supported.
"""

from dataclasses import asdict

from pipeline.errors import ConfigError
from pipeline.models.args import ROPE_TYPES, RopeScaling

READ = {
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "tie_word_embeddings",
    "hidden_act", "hidden_activation", "attention_bias", "mlp_bias", "lm_head_bias",
    "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "max_position_embeddings",
    "original_max_position_embeddings", "rope_local_base_freq",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "sliding_window_pattern",
    "_sliding_window_pattern", "no_rope_layers", "no_rope_layer_interval",
    "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention",
    "full_attn_mod", "interpolate_factor",
}
# training, generation and bookkeeping fields: no effect on the logits of a forward pass
INERT = {
    "transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "attention_dropout", "resid_pdrop", "embd_pdrop", "pretraining_tp",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "id2label", "label2id", "problem_type", "cache_implementation", "auto_map",
    "tokenizer_class", "use_return_dict", "tie_encoder_decoder", "torchscript", "finetuning_task",
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
TIED_BY_DEFAULT = ("gemma3", "smollm3")  # transformers' config classes' tie_word_embeddings where config.json omits it
LAYER_KINDS = {"full_attention": "F", "sliding_attention": "R"}


def settings_of(config: dict, family: str, where: str) -> dict:
    """{ModelArgs field: value} of a ``config.json`` of ``family``; ``where`` names the file in errors."""
    def refuse(key: str, want: str) -> ConfigError:
        return ConfigError(f"{where}: {key}={config[key]!r} is not supported; {want}")

    if unknown := sorted(set(config) - READ - INERT):
        raise ConfigError(f"{where}: field {unknown[0]}={config[unknown[0]]!r} is not understood by the {family} reader "
                          f"(it may change the model); supported fields: the ones transformers' {family} config has")
    act_key = "hidden_activation" if family == "gemma3" else "hidden_act"
    act = config.get(act_key) or config.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ConfigError(f"{where}: {act_key}={act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    for key in ("mlp_bias", "lm_head_bias", "use_bidirectional_attention"):
        if config.get(key):
            raise refuse(key, "only false")
    if config.get("attention_bias") and family != "qwen2":
        raise refuse("attention_bias", f"a {family} model has no q/k/v biases")
    if config.get("attn_logit_softcapping") is not None:
        raise refuse("attn_logit_softcapping", "only null (Gemma 3 has none)")
    for key in ("full_attn_mod", "interpolate_factor"):  # Phi-4-mini's, at the values transformers ignores
        if config.get(key, 1) != 1:
            raise refuse(key, "only 1")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "rms_norm_eps")
    if missing := [key for key in required if config.get(key) is None]:
        raise ConfigError(f"{where}: field {missing[0]} is missing; a {family} config.json has {', '.join(required)}")
    heads, n_layers = config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    global_rope, local_rope = _rope_parameters(config, family, where)
    rotary = int(head_dim * global_rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    settings = {
        "vocab_size": config["vocab_size"], "dim": config["hidden_size"], "n_layers": n_layers,
        "context_length": int(config.get("max_position_embeddings") or 0),  # kv.capacity: null derives from it
        "n_heads": heads, "n_kv_heads": config.get("num_key_value_heads") or heads, "head_dim": head_dim,
        "hidden_dim": config["intermediate_size"], "norm_eps": float(config["rms_norm_eps"]),
        "tie_embeddings": bool(config.get("tie_word_embeddings", family in TIED_BY_DEFAULT)),
        "mlp_act": ACTIVATIONS[act], "rope_base": float(global_rope.get("rope_theta", 10000.0)),
        "rope_scaling": _scaling(global_rope, config, where), "rope_dim": 0 if rotary == head_dim else rotary,
        "rope_local_base": float(local_rope["rope_theta"]) if local_rope else 0.0,
        "rope_layers": _rope_layers(config, n_layers), **_windows(config, family, n_layers, where),
    }
    if family == "gemma3":
        settings["attn_scale"] = float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5
        settings["post_norm_eps"] = settings["norm_eps"]
        settings["logit_soft_cap"] = float(config.get("final_logit_softcapping") or 0.0)
    elif config.get("final_logit_softcapping") is not None:
        raise refuse("final_logit_softcapping", f"a {family} model has none")
    return settings


def _rope_parameters(config: dict, family: str, where: str) -> tuple[dict, dict | None]:
    """(the flat layers' RoPE parameters, the sliding layers' own or None): ``rope_parameters`` (one dict,
    or one per layer type) or the older ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full, sliding = params.get("full_attention") or {}, params.get("sliding_attention")
        if sliding and sliding.get("rope_type", sliding.get("type", "default")) != "default":
            raise ConfigError(f"{where}: rope_parameters.sliding_attention.rope_type="
                              f"{sliding.get('rope_type', sliding.get('type'))!r} is not supported; only default")
        if sliding and sliding.get("rope_theta") == full.get("rope_theta"):
            sliding = None
        return full, sliding
    if not params:
        params = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000.0)}
    local = config.get("rope_local_base_freq")
    return params, ({"rope_theta": local} if local and local != params.get("rope_theta") else None)


def _scaling(rope: dict, config: dict, where: str) -> dict:
    """``ModelArgs.rope_scaling`` (every field, so that it replaces a preset's whole)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return asdict(RopeScaling())
    max_positions = config.get("max_position_embeddings", 0)
    original = int(config.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or max_positions)
    out = {"type": kind, "original_context": original}
    factor = rope.get("factor")
    if kind == "longrope":
        factor = factor or (max_positions / original if original else 1.0)
        out |= {"short_factor": list(rope["short_factor"]), "long_factor": list(rope["long_factor"])}
    out["factor"] = float(factor if factor is not None else 1.0)
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "truncate"):
        if rope.get(key) is not None:
            out[key] = rope[key]
    for key in ("mscale", "mscale_all_dim"):
        if rope.get(key):
            raise ConfigError(f"{where}: rope {key}={rope[key]!r} is not supported (yarn's DeepSeek variant)")
    return asdict(RopeScaling(**out))


def _rope_layers(config: dict, n_layers: int) -> str:
    """SmolLM3's ``no_rope_layers`` (1: the layer uses RoPE) as our per-layer pattern; "" when all do."""
    flags = config.get("no_rope_layers")
    if flags is None and config.get("no_rope_layer_interval"):
        flags = [int((i + 1) % config["no_rope_layer_interval"] != 0) for i in range(n_layers)]
    if not flags or all(flags):
        return ""
    return "".join("1" if f else "0" for f in flags)


def _windows(config: dict, family: str, n_layers: int, where: str) -> dict:
    """Our ``sliding_window`` and ``layer_pattern`` (R: sliding, F: full) from ``layer_types``, or the older fields:
    Qwen2's ``use_sliding_window`` from ``max_window_layers`` on, Gemma 3's ``sliding_window_pattern``,
    Mistral's and Phi-3's window on every layer."""
    window = config.get("sliding_window")
    kinds = config.get("layer_types")
    if kinds is None:
        if family in ("qwen2", "qwen3", "smollm3"):
            slides = config.get("use_sliding_window", False) and window is not None
            kinds = ["sliding_attention" if slides and i >= config.get("max_window_layers", 0) else "full_attention"
                     for i in range(n_layers)]
        elif family == "gemma3":
            every = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
            kinds = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
        else:
            kinds = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    if bad := [k for k in kinds if k not in LAYER_KINDS]:
        raise ConfigError(f"{where}: layer_types has {bad[0]!r}; supported: {', '.join(LAYER_KINDS)}")
    if len(kinds) != n_layers:
        raise ConfigError(f"{where}: layer_types has {len(kinds)} entries for num_hidden_layers={n_layers}")
    if family == "smollm3" and not config.get("use_sliding_window"):
        kinds = ["full_attention"] * n_layers  # SmolLM3 slides its sliding layers only with use_sliding_window
    if window and window >= config.get("max_position_embeddings", window + 1):
        kinds = ["full_attention"] * n_layers  # a window past every position the model takes is no window (Phi-4-mini's)
    if "sliding_attention" not in kinds:
        return {"sliding_window": 0, "layer_pattern": "F"}
    if not window:
        raise ConfigError(f"{where}: sliding layers in layer_types but sliding_window={window!r}; expected a window size")
    return {"sliding_window": int(window), "layer_pattern": "".join(LAYER_KINDS[k] for k in kinds)}
