"""The AOTInductor runner used for GPU validation, exercised on the CPU: methods compiled
separately must share one set of KV stores and match the oracle through an episode."""

from conftest import compose_config
from pipeline.runtime.aoti import compile_methods
from pipeline.runtime.session import Session
from pipeline.stages import compile as compile_stage
from pipeline.stages import export, lower_kv, validate


def test_aoti_methods_share_stores_and_match_oracle(tmp_path):
    cfg = compose_config("kv=cell", "kv.max_seqs=2", "kv.capacity=128", "backend=portable", "model=tiny_flat")
    exported = export.run(cfg.model, cfg.kv, {}, tmp_path)
    lowered = lower_kv.run(cfg.kv, cfg.backend, exported, tmp_path)
    compile_stage.run(cfg.backend, {**exported, **lowered}, tmp_path)  # manifest.json for the session
    methods = compile_methods(compile_stage.backend_programs(lowered["lowered"], "portable"), device="cpu")
    session = Session(tmp_path, methods=methods)
    scripts = validate.plan(cfg.validate, session.max_seqs, exported["model"].args.vocab_size)
    stats = validate.run_episode(session, exported["model"], scripts, causal=True)
    assert stats["decode_steps"] > 0 and stats["steps"] > stats["decode_steps"]
    # decode steps read what prefill steps (another compiled method) wrote: not shared -> large errors
    assert max(max(s.errors) for s in scripts) < 1e-4
