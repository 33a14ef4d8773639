"""Config composition of every option and experiment, and bad input on the command line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import CONF, compose_config
from pipeline.errors import ConfigError

GROUPS = ["model", "draft", "vision", "kv", "backend", "experiment"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((Path(CONF) / g).glob("*.yaml"))]


def test_defaults():
    cfg = compose_config()
    assert cfg.model.name == "tiny" and cfg.kv.layout == "sequence" and cfg.kv.max_seqs == 1
    assert cfg.backend.name == "xnnpack" and cfg.draft.name == "none" and cfg.vision.name == "none"
    assert list(cfg.stages) == ["export_vision", "export", "lower_kv", "compile", "validate"]


# options buildable only beyond the defaults: Muse Glimmer at its real size (for its 17 GB checkpoint) has windows
# of 2048 tokens and an estimated build of ~560 GB
NEEDS = {("model", "muse_glimmer"): ["kv.capacity=4096", "memory_budget_gb=1000"]}


@pytest.mark.parametrize("group,option", OPTIONS)
def test_every_option_composes_and_checks(group, option):
    from pipeline.build.plan import resolve, resolve_model

    extra = NEEDS.get((group, option), [])
    cfg = compose_config(f"{group}={option}", *extra)
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    if cfg.backend.name == "cuda":  # CI has no GPU: check what can be built here
        cfg = compose_config(f"{group}={option}", "stages=[export,lower_kv]")
    resolve(resolve_model(cfg, []))  # every shipped option is buildable (with NEEDS)


def test_experiment_holds_only_its_differences():
    cfg = compose_config("experiment=batched8")
    assert cfg.experiment_name == "batched8" and cfg.kv.max_seqs == 8 and cfg.kv.layout == "sequence"
    assert compose_config("experiment=cell4").kv.layout == "cell"
    assert compose_config("experiment=portable_flat").backend.name == "portable"


def test_issue_example_override_accepted():
    cfg = compose_config("kv=sequence", "kv.max_seqs=1", "model=tiny", "stages=[export,lower_kv,compile]")
    assert list(cfg.stages) == ["export", "lower_kv", "compile"]


def test_schema_rejects_wrong_type():
    with pytest.raises(Exception, match="max_seqs"):
        compose_config("kv.max_seqs=lots")


BAD_INPUT = [
    (["kv=foo"], ["kv=foo", "cell", "sequence"]),
    (["kv.max_seqs=0"], ["kv.max_seqs=0", "at least 1"]),
    (["kv.capacity=-5"], ["kv.capacity=-5", "positive"]),
    (["stages=[export,frobnicate]"], ["frobnicate", "export_vision, export, lower_kv, compile, validate"]),
    (["stages=[compile,export]"], ["'compile' needs", "lower_kv", "before it"]),
    (["kv=cell", "kv.max_seqs=64"], ["kv.max_seqs=64", "63", "kv=sequence"]),
    (["kv.capacity=8", "kv.max_step_tokens=8"], ["model.sliding_window=16", "kv.capacity=8"]),
    (["kv=cell", "kv.max_seqs=40"], ["kv.max_seqs=40", "kv.capacity=512"]),
    (["backend=cuda"], ["backend=cuda needs a CUDA GPU", "stages=[export,lower_kv]"]),
    (["backend=tpu"], ["backend=tpu", "cuda, portable, xnnpack"]),
    (["kv.dtype=int3"], ["kv.dtype=int3", "bfloat16"]),
    (["validate.runtime=tensorrt"], ["validate.runtime=tensorrt", "one of inductor, aoti"]),
    (["model.dtype=int7"], ["model.dtype=int7 is not one of float32, bfloat16, float16"]),
    (["validate.metric=l2"], ["validate.metric=l2 is not one of range, norm"]),
    # issue 10: what used to build for minutes, exhaust the machine or print Hydra's pages
    (["kv.max_seqs=1000000"], ["kv.max_seqs=1000000", "GB", "over the budget", "this machine's memory"]),
    (["memory_budget_gb=0.01"], ["estimated", "memory_budget_gb=0.01"]),
    # issue 49: a capacity the budget cannot hold names the largest it can; a derived one that finds none is refused
    (["kv.max_seqs=8", "kv.capacity=1000000", "memory_budget_gb=1"],
     ["kv.max_seqs=8, kv.capacity=1000000", "over the budget of 1.0 GB (memory_budget_gb=1.0)",
      "at kv.max_seqs=8 the budget holds at most kv.capacity="]),
    (["model=smollm2_135m", "kv.max_seqs=8", "memory_budget_gb=2"],
     ["kv.capacity=null derives the context from the model's 8192 tokens", "not even kv.capacity=64 fits",
      "memory_budget_gb=2.0", "lower kv.max_seqs"]),
    (["kv.capacity=auto"], ["kv.capacity=auto is not an integer or null"]),
    (["+unknown_key=1"], ["unknown_key=1 is not a setting", "kv, backend, quant, validate"]),
    (["unknown_key=1"], ["unknown_key=1 is not a setting"]),
    (["+kv.foo=1"], ["kv.foo=1 is not a setting", "max_seqs, capacity"]),
    (["kv.max_seqs=abc"], ["kv.max_seqs=abc is not an integer"]),
    (["model.causal=maybe"], ["model.causal=maybe is not a boolean"]),
    (["validate.prompt_lengths=[a,b]"], ["validate.prompt_lengths", "list of integers"]),
    (["-m", "kv.max_seqs=1,abc"], ["kv.max_seqs=abc is not an integer"]),
    (["~kv.dtype"], ["~kv.dtype", "cannot be deleted"]),
    (["kv.max_seqs=[1"], ["kv.max_seqs=[1", "parse"]),
    (["model.dim=66"], ["model.dim=66", "model.n_heads=4"]),
    (["model.n_kv_heads=3"], ["model.n_heads=4", "model.n_kv_heads=3"]),
    (["model.layer_pattern=FX"], ["model.layer_pattern='FX'", "F (flat) and R (ring)"]),
    (["model.sliding_window=0"], ["model.sliding_window=0", "ring layers"]),
    (["kv.capacity=40"], ["kv.capacity=40", "validation episode", "at least 49"]),
    (["kv=cell", "kv.max_seqs=32"], ["kv.capacity=512", "validation episode", "1044"]),
    (["validate.decode_steps=0"], ["validate.decode_steps=0", "at least 1"]),
    # issue 12: a draft that does not fit its target
    (["draft=dflash", "draft.target_layer_ids=[1,9]"], ["draft.target_layer_ids=[1, 9]", "layer 9", "model.n_layers=4"]),
    (["draft=dflash", "draft.block_size=32"], ["draft.block_size=32", "kv.max_step_tokens=16"]),
    (["draft=dflash", "draft.mask_token_id=600"], ["draft.mask_token_id=600", "model.vocab_size=512"]),
    (["draft=dflash", "draft.checkpoint=/nonexistent"], ["draft.checkpoint=/nonexistent", "no config.json"]),
    (["vision=smolvlm_tiny", "vision.out_dim=48"], ["vision.out_dim=48", "model.dim=64"]),
    (["vision=smolvlm_tiny", "vision.image_token_id=512"], ["vision.image_token_id=512", "model.vocab_size=512"]),
    (["vision=smolvlm_tiny", "vision.image_size=36"], ["vision.image_size=36", "multiple of", "16"]),
    (["vision=smolvlm_tiny", "vision.image_size=256"], ["an image is 256 tokens", "kv.capacity=128"]),
    (["vision=smolvlm_tiny", "stages=[export,lower_kv]"], ["needs the export_vision stage"]),
    # issue 14: quantizations this build cannot make
    (["quant=int5"], ["quant=int5", "from_checkpoint, int4, int8, none"]),
    (["quant.scheme=int5"], ["quant.scheme=int5 is not one of none, int8, int4, from_checkpoint"]),
    (["quant=int4"], ["quant.group_size=32", "input width 176", "feed_forward.w2", "quant=int8"]),
    (["quant=int4", "model.hidden_dim=192", "quant.group_size=96"], ["quant.group_size=96", "input width 64", "(32, 64)"]),
    (["quant=int4", "model.hidden_dim=192", "quant.group_size=40"], ["quant.group_size=40", "multiple of 32"]),
    (["quant=int8", "quant.group_size=32"], ["quant.group_size=32", "one scale per output channel"]),
    (["quant=int4", "model.hidden_dim=192", "quant.head_bits=6"], ["quant.head_bits=6", "8-bit per channel (8)"]),
    (["quant=int8", "quant.scales=hqq"], ["quant.scales=hqq", "quant=int8", "8-bit per channel", "no_clipping / 8"]),
    (["quant=int4", "quant.scales=minmax"], ["quant.scales=minmax", "symmetric, no_clipping, hqq"]),
    (["quant=int8", "validate.max_mean_kld=0"], ["validate.max_mean_kld=0", "must be positive"]),
    (["quant=int8", "validate.min_top1_agreement=1.5"], ["validate.min_top1_agreement=1.5", "fraction"]),
    (["quant=from_checkpoint"], ["quant=from_checkpoint", "model.checkpoint=null", "quant=int4"]),
    (["quant=int8", "backend=portable"], ["quant.scheme=int8 needs backend=xnnpack"]),
    (["quant.draft=true"], ["quant.draft=true with quant.scheme=none", "quant=int8"]),
    (["quant=int8", "quant.draft=true"], ["quant.draft=true with draft=none", "draft=dflash"]),
    (["quant=int4", "model.hidden_dim=192", "draft=dflash", "quant.draft=true"],
     ["quant.group_size=32", "input width 176", "draft feed_forward.w2", "(draft dflash)"]),
    (["quant=int8", "draft=dflash", "quant.draft=true", "kv=cell"], ["quant.draft=true with kv=cell", "kv=sequence"]),
    (["model=phi4_mini_tiny", "kv.capacity=8192"], ["model.rope_scaling.type=longrope", "original_context=4096",
                                                    "kv.capacity=8192"]),
    (["model=llama3_tiny", "model.rope_scaling.type=ntk"], ["model.rope_scaling.type=ntk is not supported", "llama3"]),
    (["model=phi4_mini_tiny", "model.rope_dim=14"], ["model.rope_scaling.short_factor has 6 values", "(7)"]),
    (["model.rope_layers=12"], ["model.rope_layers='12'", "1 (RoPE) and 0"]),
    (["model.mlp_act=relu"], ["model.mlp_act=relu", "silu, gelu_tanh"]),
    (["vision.checkpoint=/x.gguf"], ["vision.checkpoint=/x.gguf is set but vision=none"]),
    # what gets past the checks to Hydra, shortened to one line
    (["kv.max_seqs=1,2"], ["kv.max_seqs=1,2", "add --multirun"]),
    (["hydra.job.chdir=maybe"], ["hydra.job.chdir=maybe", "not a valid bool"]),
]


@pytest.mark.parametrize("args,needles", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_one_line_error_no_version(tmp_path, args, needles):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "pipeline", f"output_root={tmp_path}", *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1, proc.stderr  # one line, nothing else
    for needle in needles:
        assert needle in proc.stderr
    assert list(tmp_path.iterdir()) == [], "a rejected config must not create output directories"


def test_refused_before_heavy_imports():
    """Config checks import neither torch nor executorch (the error path stays fast)."""
    code = ("import sys; from pipeline.build.plan import resolve; from conftest import compose_config; "
            "resolve(compose_config('kv=cell', 'kv.max_seqs=8')); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'executorch'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout
    assert out.strip() == "[]"


def test_schema_is_strict_in_composed_configs():
    from pipeline.build.plan import resolve

    with pytest.raises(ConfigError, match="experiment_nme=x is not a setting"):
        resolve(compose_config("+experiment_nme=x"))


def test_help_describes_the_command():
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--help"], capture_output=True, text=True, check=True)
    for needle in ("Builds a deployable ExecuTorch LLM artifact", "== Stages", "lower_kv", "== Config groups",
                   "kv: cell, sequence", "== Examples", "-m kv=sequence,cell"):
        assert needle in proc.stdout


def test_backend_and_layout_modules_match_their_config_groups():
    """A backend is a module of pipeline/backends plus conf/backend/<name>.yaml, a layout a
    pipeline/kv/layout_<name>.py plus conf/kv/<name>.yaml: the two lists agree."""
    from pathlib import Path

    from pipeline.backends import backend, names
    from pipeline.kv.layouts import layout_names

    conf = Path(__file__).resolve().parent.parent / "conf"
    assert names() == sorted(p.stem for p in (conf / "backend").glob("*.yaml"))
    assert layout_names() == sorted(p.stem for p in (conf / "kv").glob("*.yaml"))
    assert all(backend(n).name == n for n in names())
