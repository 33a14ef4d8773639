"""kv.capacity and kv.max_step_tokens left null: derived from the model's own context within the serving caps
and the memory budget (a checkpoint's model), or the fixed defaults (random weights); from the config alone."""

import json

import pytest

from conftest import compose_config, gguf_writer
from pipeline.build.context import FIXED_CAPACITY, QUANTUM, SERVING_KV_BYTES, SERVING_SCRATCH_BYTES, SERVING_STEP_TOKENS
from pipeline.build.feasibility import GB
from pipeline.build.plan import plan_of
from pipeline.errors import ConfigError

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 8192}
# wide enough that 8 sequences of 8192 tokens pass the serving caps: 16 layers of 4 KV heads of 64
WIDE = TINY | {"hidden_size": 256, "num_hidden_layers": 16, "num_key_value_heads": 4, "intermediate_size": 512}


def checkpoint(tmp_path, config: dict) -> str:
    """A Hugging Face directory with only its config.json: the plan reads no weights."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def plan(*overrides: str):
    return plan_of(compose_config(*overrides), list(overrides))


def estimate(*overrides: str) -> dict:
    """The explicit path's numbers at a set kv.capacity: KV bytes, the target's scratch, the build's peak."""
    p = plan(*overrides, "memory_budget_gb=1000")
    return {"kv": p.memory["kv"], "scratch": p.target.layout.attention_scratch_bytes(), "peak": p.memory["peak"]}


def test_a_checkpoint_model_gets_its_own_context(tmp_path):
    p = plan(f"+model.checkpoint={checkpoint(tmp_path, TINY)}", "kv.max_seqs=8")
    assert p.config.model.context_length == 8192  # config.json's max_position_embeddings
    assert (p.config.kv.capacity, p.config.kv.max_step_tokens) == (8192, SERVING_STEP_TOKENS)
    assert p.target.layout.max_seq_len == 8192 and p.target.layout.max_step_tokens == SERVING_STEP_TOKENS
    assert p.context.capacity_from == "the model's context (model.context_length=8192)"


def test_random_weights_keep_the_fixed_defaults():
    for layout in ("sequence", "cell"):
        p = plan(f"kv={layout}")
        assert p.config.model.context_length == 0
        assert (p.config.kv.capacity, p.config.kv.max_step_tokens) == (FIXED_CAPACITY[layout], 16)
    assert compose_config().kv.capacity is None  # the composed config says "derive"; the plan's says the value


def test_set_values_are_kept_and_the_caller_config_untouched(tmp_path):
    cfg = compose_config(f"+model.checkpoint={checkpoint(tmp_path, TINY)}", "kv.capacity=32",
                         "stages=[export,lower_kv,compile]")  # no validation episode: it needs 49 tokens
    p = plan_of(cfg)
    assert (p.config.kv.capacity, p.config.kv.max_step_tokens) == (32, 32)  # the step: at most the set capacity
    assert p.context.capacity_from == "set" and p.context.step_from != "set"
    assert cfg.kv.capacity == 32 and cfg.kv.max_step_tokens is None
    p = plan(f"+model.checkpoint={checkpoint(tmp_path, WIDE)}", "kv.capacity=8192", "kv.max_seqs=8")
    assert p.config.kv.capacity == 8192  # a set capacity passes the serving caps: they shape the default only


def test_the_serving_caps_bound_the_default(tmp_path):
    """8 sequences of WIDE's 8192 tokens would put the stores or the scratch over a serving cap: the default is the
    largest multiple of QUANTUM within both, as the explicit path measures them."""
    ckpt = f"+model.checkpoint={checkpoint(tmp_path, WIDE)}"
    full = estimate(ckpt, "kv.max_seqs=8", "kv.capacity=8192")
    assert full["kv"] > SERVING_KV_BYTES or full["scratch"] > SERVING_SCRATCH_BYTES
    p = plan(ckpt, "kv.max_seqs=8")
    capacity = p.config.kv.capacity
    assert capacity % QUANTUM == 0 and capacity < 8192
    within = estimate(ckpt, "kv.max_seqs=8", f"kv.capacity={capacity}")
    beyond = estimate(ckpt, "kv.max_seqs=8", f"kv.capacity={capacity + QUANTUM}")
    assert within["kv"] <= SERVING_KV_BYTES and within["scratch"] <= SERVING_SCRATCH_BYTES
    assert beyond["kv"] > SERVING_KV_BYTES or beyond["scratch"] > SERVING_SCRATCH_BYTES
    assert f"capped: at {capacity + QUANTUM} tokens" in p.context.capacity_from and "serving cap" in p.context.capacity_from


def test_the_memory_budget_bounds_the_default(tmp_path):
    ckpt = f"+model.checkpoint={checkpoint(tmp_path, TINY)}"
    budget = 0.9  # GB: the tiny model's 8192 tokens x 8 sequences need more, 256 tokens need less
    assert estimate(ckpt, "kv.max_seqs=8", "kv.capacity=8192")["peak"] > budget * GB
    p = plan(ckpt, "kv.max_seqs=8", f"memory_budget_gb={budget}")
    capacity = p.config.kv.capacity
    assert capacity % QUANTUM == 0 and estimate(ckpt, "kv.max_seqs=8", f"kv.capacity={capacity}")["peak"] <= budget * GB
    assert estimate(ckpt, "kv.max_seqs=8", f"kv.capacity={capacity + QUANTUM}")["peak"] > budget * GB
    assert f"over the budget of {budget:.1f} GB (memory_budget_gb={budget})" in p.context.capacity_from


def test_a_budget_that_holds_no_context_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"kv.capacity=null derives the context from the model's 8192 tokens, but at "
                                          r"kv.max_seqs=8 not even kv.capacity=64 fits: .*memory_budget_gb=0.5"):
        plan(f"+model.checkpoint={checkpoint(tmp_path, TINY)}", "kv.max_seqs=8", "memory_budget_gb=0.5")


def test_a_set_capacity_over_the_budget_names_the_largest_that_fits():
    args = ("kv.max_seqs=8", "memory_budget_gb=1")
    with pytest.raises(ConfigError) as refused:
        plan(*args, "kv.capacity=1000000")
    message = str(refused.value)
    assert message.startswith("kv.max_seqs=8, kv.capacity=1000000: the KV stores take") and "memory_budget_gb=1" in message
    most = int(message.rpartition("at most kv.capacity=")[2])
    plan(*args, f"kv.capacity={most}")  # fits
    with pytest.raises(ConfigError, match=f"kv.capacity={most + 1}: .* over the budget"):
        plan(*args, f"kv.capacity={most + 1}")


def test_a_static_rope_bounds_the_default(tmp_path):
    """longrope changes its frequencies past the original context: the default stops there."""
    rope = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                             "original_max_position_embeddings": 512}}
    config = TINY | {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"} | rope
    p = plan(f"+model.checkpoint={checkpoint(tmp_path, config)}")
    assert p.config.model.context_length == 8192 and p.config.kv.capacity == 512


def test_a_gguf_says_its_context(tmp_path):
    path = tmp_path / "tiny.gguf"
    w = gguf_writer(path, "llama", n_layers=4, dim=64, hidden_dim=176, n_heads=4, n_kv_heads=2, norm_eps=1e-5,
                    rope_base=10000.0, vocab_size=512)
    w.add_context_length(2048)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = plan(f"+model.checkpoint={path}", "kv.max_seqs=2")
    assert p.config.model.context_length == 2048 and p.config.kv.capacity == 2048


def test_the_dry_run_says_the_context(tmp_path, capsys):
    from pipeline.build.runner import build

    ckpt = f"+model.checkpoint={checkpoint(tmp_path / 'ckpt', WIDE)}"
    assert build(compose_config(f"output_root={tmp_path}", ckpt, "kv.max_seqs=8", "dry_run=true"), [ckpt]) is None
    out = capsys.readouterr().out
    capacity = plan(ckpt, "kv.max_seqs=8").config.kv.capacity
    assert f"  context: {capacity} tokens per sequence x kv.max_seqs=8; prompts in steps of up to 64 tokens\n" in out
    assert f"    kv.capacity={capacity} (null in the config): the model's context of 8192 tokens, capped" in out
    assert build(compose_config(f"output_root={tmp_path}", "kv=cell", "dry_run=true")) is None
    out = capsys.readouterr().out
    assert "  context: a pool of 512 tokens shared by kv.max_seqs=4 sequences (one sequence up to 512)" in out
    assert "    kv.capacity=512 (null in the config): the layout's default for a model without a context" in out
    assert build(compose_config(f"output_root={tmp_path}", "kv.capacity=96", "kv.max_step_tokens=8", "dry_run=true")) is None
    out = capsys.readouterr().out
    assert "  context: 96 tokens per sequence x kv.max_seqs=1; prompts in steps of up to 8 tokens\n" in out
    assert "(null in the config)" not in out  # both set: nothing derived to explain
    assert not any(tmp_path.glob("*/v*"))
