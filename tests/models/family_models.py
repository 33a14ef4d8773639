"""Tiny random Hugging Face models of each family with the family's real features, written by transformers
(``save_pretrained``, safetensors): the oracles of ``test_families.py`` (and the GGUF tests)."""

from pathlib import Path

import torch

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 8  # sliding windows shorter than the sequences the tests run, so that the window shows


def configs() -> dict:
    """{name: (transformers config class name, model class name, config kwargs)}; a short RoPE context
    (original_max_position_embeddings 64) stands for the real 8k so that a 60-token test crosses it."""
    return {
        # Llama 3.2 1B/3B: llama3 scaling (factor 32, low 1, high 4, theta 500000), tied head
        "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
            num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=2048, rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64))),
        # Qwen2.5 with its sliding window on, from max_window_layers (1 of 3 layers full)
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
            num_hidden_layers=3, tie_word_embeddings=True, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=1)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2, head_dim=24, tie_word_embeddings=False)),
        # Gemma 3: 5 local : 1 global, local base 10k, global 1M with linear scaling 8 (4B+), query_pre_attn_scalar
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
            num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=2048,
            rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                             "full_attention": dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)})),
        # Phi-4-mini: partial rotary 0.75, longrope (short factors within the original context), tied head
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
            num_hidden_layers=2, tie_word_embeddings=True, max_position_embeddings=4096,
            original_max_position_embeddings=256, rope_parameters=dict(
                rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                short_factor=[1.0 + 0.25 * i for i in range(6)], long_factor=[2.0 + i for i in range(6)]))),
        # SmolLM3: no RoPE on every 4th layer
        "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
            num_hidden_layers=4, no_rope_layer_interval=4, tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=2000000.0))),
        # Mistral: a sliding window on every layer
        "mistral": ("MistralConfig", "MistralForCausalLM", dict(
            num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False)),
    }


FAMILY = {"llama3": "llama"}  # the family each model is (else its name)


def save(name: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """The model ``name`` at random weights from ``seed``, norms and biases moved off their init (so that a
    dropped one shows), saved to ``path``; returned in eval mode, fp32."""
    import transformers

    config_cls, model_cls, kwargs = configs()[name]
    config = getattr(transformers, config_cls)(**TINY, **kwargs)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if "norm" in p_name or "bias" in p_name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    return model
