"""Every model family from its Hugging Face directory, against transformers on the same files.

Tiny random models with each family's real features (``family_models.py``: Llama 3.2's llama3 RoPE scaling,
Qwen2.5's sliding window, Gemma 3's 5:1 pattern and two RoPE bases, Phi-4-mini's partial rotary and longrope,
SmolLM3's NoPE layers, Mistral's window) are read by our loader; the eager decoder, then the ``.pte`` of each
layout over a continuous-batching episode, equal transformers' forward of each sequence alone; planted errors
(a wrong RoPE factor, a missing (1 + w), a dropped window ...) are caught by the same comparison.
"""

import json

import family_models
import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import resolve_model
from pipeline.errors import ConfigError
from test_loaders import our_greedy, our_logits, ours, relative

transformers = pytest.importorskip("transformers")

NAMES = list(family_models.configs())
BOUND = 1e-4  # fp32, relative to the logit range (the bound; the eager decoder is exact here)
VOCAB = family_models.TINY["vocab_size"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (directory, transformers model)}, each written once for the module."""
    root = tmp_path_factory.mktemp("families")
    return {name: (root / name, family_models.save(name, root / name)) for name in NAMES}


def config_of(directory, *overrides):
    return resolve_model(compose_config(f"+model.checkpoint={directory}", *overrides), [])


def hf_greedy(hf, ids, n):
    seq = ids[None]
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, hf(seq).logits[:, -1:].argmax(-1)], dim=1)
    return seq[0, len(ids):].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_eager_decoder_equals_transformers(checkpoints, name):
    """60 tokens (past every window and the llama3 original context) and 16 greedy tokens."""
    directory, hf = checkpoints[name]
    cfg = config_of(directory)
    assert cfg.model.family == family_models.FAMILY.get(name, name)
    model = ours(cfg)
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert relative(our_logits(model, ids), want) <= BOUND
    assert our_greedy(model, ids[:9], 16) == hf_greedy(hf, ids[:9], 16)


def test_checkpoint_features_read(checkpoints):
    got = {name: config_of(checkpoints[name][0]).model for name in NAMES}
    assert got["llama3"].rope_scaling.type == "llama3" and got["llama3"].rope_scaling.factor == 32.0
    assert got["llama3"].rope_scaling.original_context == 64 and got["llama3"].tie_embeddings
    assert got["qwen2"].layer_pattern == "FRR" and got["qwen2"].sliding_window == family_models.WINDOW
    assert (got["gemma3"].layer_pattern, got["gemma3"].rope_local_base, got["gemma3"].rope_base) == ("RRRRRF", 1e4, 1e6)
    assert got["gemma3"].rope_scaling.type == "linear" and got["gemma3"].attn_scale == pytest.approx(24 ** -0.5)
    assert got["phi3"].rope_dim == 12 and got["phi3"].rope_scaling.type == "longrope"
    assert got["smollm3"].rope_layers == "1110" and got["mistral"].layer_pattern == "RR"


# a planted error per feature: the comparison above fails on each (so it can fail)
PLANTED = [
    ("llama3", "rope_scaling.factor", 8.0, "a wrong RoPE factor"),
    ("llama3", "rope_scaling.type", "default", "RoPE scaling dropped"),
    ("gemma3", "rope_local_base", 0.0, "one RoPE base for both layer kinds"),
    ("gemma3", "embed_scale", False, "embeddings not scaled"),
    ("gemma3", "mlp_act", "silu", "SwiGLU for GeGLU"),
    ("phi3", "rope_scaling.attention_factor", 1.0, "longrope's attention factor dropped"),
    ("phi3", "rope_dim", 16, "full rotary for partial"),
    ("smollm3", "rope_layers", "", "RoPE on the NoPE layers"),
    ("qwen2", "layer_pattern", "F", "the sliding window dropped"),
    ("mistral", "sliding_window", 9, "a window one too wide"),
]


@pytest.mark.parametrize("name,key,value,what", PLANTED, ids=[p[3] for p in PLANTED])
def test_planted_error_is_caught(checkpoints, name, key, value, what):
    from omegaconf import OmegaConf

    directory, hf = checkpoints[name]
    cfg = config_of(directory)
    OmegaConf.update(cfg, f"model.{key}", value)
    if key == "rope_dim":  # longrope has a factor per rotated pair: as many as the full head needs
        OmegaConf.update(cfg, "model.rope_scaling.short_factor", [1.0] * 8)
    ids = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert relative(our_logits(ours(cfg), ids), want) > BOUND, what


def test_gemma_norms_without_the_unit_offset_are_caught(checkpoints, monkeypatch):
    """Gemma's RMSNorm scales by (1 + w): read as plain w, the model is wrong."""
    from pipeline.models.loaders import hf as hf_loader

    directory, hf = checkpoints["gemma3"]
    split = hf_loader._split
    monkeypatch.setattr(hf_loader, "_split", lambda ours, t, args, family, where: split(ours, t, args, "gemma", where))
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    assert relative(our_logits(ours(config_of(directory)), ids), want) > 10 * BOUND


def test_unknown_config_field_and_rope_type_refused(checkpoints, tmp_path):
    import shutil

    directory = tmp_path / "llama3"
    shutil.copytree(checkpoints["llama3"][0], directory)
    config = json.loads((directory / "config.json").read_text())
    cases = [({"attn_temperature_tuning": True}, r"field attn_temperature_tuning=True is not understood"),
             ({"rope_parameters": {**config["rope_parameters"], "rope_type": "proportional"}},
              r"rope_type='proportional' is not supported; supported: default, linear, dynamic, llama3, yarn, longrope"),
             ({"hidden_act": "relu"}, r"hidden_act='relu' is not supported"),
             ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
             ({"rms_norm_eps": None}, r"field rms_norm_eps is missing")]
    for change, message in cases:
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=rf"model.checkpoint={directory}: config.json: {message}"):
            config_of(directory)


def test_static_rope_refuses_contexts_beyond_its_original(checkpoints):
    from pipeline.build.plan import resolve

    with pytest.raises(ConfigError, match=r"model.rope_scaling.type=longrope changes its frequencies beyond "
                                          r"original_context=256 positions.*kv.capacity=512"):
        resolve(config_of(checkpoints["phi3"][0], "kv.capacity=512"))


# --- the artifact: each family in both layouts, through a continuous-batching episode ---

# each family on both CPU backends, a layout on each: XNNPACK (the default, where a delegated op may compute
# something other than torch: tests/backends/test_elementwise.py) and portable
LAYOUTS = {"sequence": ["kv=sequence", "kv.max_seqs=4", "kv.capacity=96", "backend=xnnpack"],
           "cell": ["kv=cell", "kv.max_seqs=4", "kv.capacity=256", "backend=portable"]}


def episode(session, hf, gen):
    """Four sequences in one artifact: staggered prompts prefilled in chunks beside others' decodes, one
    leaving and a fifth taking its place; every step's logits against transformers' forward of that sequence
    alone, and each greedy continuation against transformers' greedy decode. Returns the worst error."""
    prompts = {f"s{i}": torch.randint(0, VOCAB, (n,), generator=gen).tolist() for i, n in enumerate((23, 5, 40, 12, 17))}
    pending = {s: list(p) for s, p in prompts.items()}
    history, made, worst, live = {s: [] for s in prompts}, {s: [] for s in prompts}, 0.0, ["s0", "s1", "s2", "s3"]
    for s in live:
        session.add(s)
    for step in range(40):
        if step == 14:  # s1 leaves; s4 takes its place
            session.release("s1")
            live = [s for s in live if s != "s1"] + ["s4"]
            session.add("s4")
        feeds = {s: [made[s][-1]] for s in live if not pending[s] and len(made[s]) < 12}
        budget = session.max_step_tokens - len(feeds)  # prompt chunks fill the step beside the decodes
        for s in live:
            if pending[s] and budget > 0:
                n = min(6, budget)
                feeds[s], pending[s], budget = pending[s][:n], pending[s][n:], budget - n
        if not feeds:
            break
        got = session.step(feeds)
        for s, toks in feeds.items():
            history[s] += toks
            if pending[s]:
                continue  # mid-prompt: no logits read
            with torch.no_grad():
                want = hf(torch.tensor([history[s]])).logits[0, -1]
            worst = max(worst, relative(got[s], want))
            made[s].append(int(got[s].argmax()))
    for s in prompts:
        if s == "s1":
            continue
        assert made[s] == hf_greedy(hf, torch.tensor(prompts[s]), len(made[s])), s
        assert len(made[s]) == 12, s
    return worst


# Gemma 3 (tanh-GELU, soft-capping, sliding layers) also in the cell layout on XNNPACK (issue 51)
CASES = [(name, layout) for name in NAMES for layout in LAYOUTS] + [("gemma3", "cell_xnnpack")]


@pytest.mark.parametrize("name,layout", CASES)
def test_artifact_equals_transformers(checkpoints, tmp_path, name, layout):
    from pipeline.build.runner import build
    from pipeline.runtime.session import Session

    directory, hf = checkpoints[name]
    options = LAYOUTS["cell"][:-1] + ["backend=xnnpack"] if layout == "cell_xnnpack" else LAYOUTS[layout]
    overrides = [f"+model.checkpoint={directory}", *options, f"output_root={tmp_path}"]
    version = build(compose_config(*overrides), overrides)
    assert json.loads((version / "validation.json").read_text())["passed"]
    worst = episode(Session(version), hf, torch.Generator().manual_seed(11))
    assert worst <= BOUND, worst


def test_bad_hf_checkpoints_refused_in_one_line(checkpoints, tmp_path):
    """Through the command line: one line naming the file, the field or tensor and what is expected; exit 2;
    no version. The first two are refused with the config, the last two when the export reads the weights."""
    import shutil

    from test_loaders import _pipeline

    def variant(name, change):
        directory = tmp_path / name
        shutil.copytree(checkpoints["mistral"][0], directory)
        change(directory)
        return directory

    def edit_config(**fields):
        def change(directory):
            config = json.loads((directory / "config.json").read_text())
            (directory / "config.json").write_text(json.dumps({**config, **fields}))
        return change

    def truncate(directory):
        data = (directory / "model.safetensors").read_bytes()
        (directory / "model.safetensors").write_bytes(data[: len(data) // 2])

    cases = [
        (variant("gpt2", edit_config(architectures=["GPT2LMHeadModel"])), "architecture 'GPT2LMHeadModel' is not supported"),
        (variant("rope", edit_config(rope_parameters={"rope_type": "su", "rope_theta": 1e4})), "rope_type='su' is not supported"),
        (variant("truncated", truncate), "model.safetensors cannot be read"),
        (variant("shapes", edit_config(intermediate_size=80)),
         "from model.dim=64, model.hidden_dim=80 (the checkpoint's config says so"),
    ]
    for directory, needle in cases:
        proc = _pipeline(tmp_path, f"+model.checkpoint={directory}", "backend=portable")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: model.checkpoint={directory}") and needle in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").rglob("v0*"))


def test_a_window_past_every_position_is_no_window(checkpoints, tmp_path):
    """Phi-4-mini's config.json has sliding_window=262144 over max_position_embeddings=131072: every layer is flat
    (a ring that long would be refused by any kv.capacity); a window within the positions stays a ring."""
    import shutil

    for window, want in ((8192, ("F", 0)), (4095, ("R", 4095))):
        directory = tmp_path / f"phi3_{window}"
        shutil.copytree(checkpoints["phi3"][0], directory)
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, "sliding_window": window}))
        model = config_of(directory).model
        assert (model.layer_pattern[0], model.sliding_window) == want
