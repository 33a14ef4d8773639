"""The whole default build through the runner, and the layouts' builds with their episodes."""

import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import BATCHED, CELL, compose_config
from pipeline.build.runner import build
from pipeline.kv.op import ReferenceCache, reference_cache


def test_default_build(build_dir):
    version = build_dir()
    assert version.name == "v0001" and version.parent.name == "default"
    for name in ("model.pte", "manifest.json", "build.json", "validation.json", ".hydra/config.yaml", ".hydra/overrides.yaml"):
        assert (version / name).exists(), name
    record = json.loads((version / "build.json").read_text())
    assert set(record["stage_seconds"]) == {"export_vision", "export", "lower_kv", "compile", "validate"}
    assert record["tools"]["executorch"] == "1.5.1" and record["tools"]["torch"].startswith("2.")
    assert record["artifacts"]["model.pte"]["bytes"] == (version / "model.pte").stat().st_size
    assert record["validation_passed"] is True
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest["backend"] == "xnnpack"
    kv = manifest["target"]
    # KV bytes: the build record, the manifest's formula and its per-layer store shapes agree
    formula = [2 * layer["rows"] * kv["columns"] * kv["n_kv_heads"] * kv["head_dim"] * 4 for layer in kv["layers"]]
    shapes = [2 * layer["store_shape"][0] * layer["store_shape"][1] * layer["store_shape"][2] * 4 for layer in kv["layers"]]
    assert record["models"]["target"]["kv_bytes_per_layer"] == formula == shapes and record["kv_bytes_total"] == sum(formula)


def test_program_matches_oracle_directly(build_dir):
    """Independent of the validate stage: load the .pte and compare one prefill with the eager model."""
    from executorch.runtime import Runtime

    from conftest import compose_config
    from pipeline.models.args import model_args
    from pipeline.models.transformer import build_model

    version = build_dir()
    cfg = compose_config()
    model = build_model(model_args(cfg.model), cfg.model.seed)
    program = Runtime.get().load_program(str(version / "model.pte"))
    tokens = torch.randint(0, cfg.model.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    emb = program.load_method("embed_text").execute([tokens])[0]
    # the 12 tokens are the step's block, over rows 0..11 of both layer kinds (no token attends alone)
    rows = torch.arange(12)
    # out_rows: token i is row 1 + i of cat(the empty alone group's one row, the block's 12)
    # block_q, out_rows, then per kind (flat, ring): one_<kind> [1, 3, 1] (no key), block_<kind> [2, 12]
    gathered = [rows, rows + 1, *[t for _ in ("flat", "ring") for t in (
        torch.tensor([[[0], [-1], [0]]]), torch.stack([rows, rows]))]]
    got = program.load_method("target_forward_from_embeddings").execute(
        [emb, torch.arange(12), torch.tensor([11]), *gathered])[0]
    with reference_cache(ReferenceCache(model.args.layer_kv())), torch.no_grad():
        want = model.logits(model.hidden(model.embed(tokens), torch.arange(12))[-1:])
    assert float((got - want).abs().max() / (want.max() - want.min())) <= 1e-4


def test_unchanged_config_builds_nothing(build_dir, capsys):
    from conftest import compose_config

    version = build_dir()
    again = build(compose_config(f"output_root={version.parent.parent}"))
    assert again == version
    out = capsys.readouterr().out
    assert "up to date" in out and "  context: 128 tokens per sequence x kv.max_seqs=1;" in out  # what it serves
    assert sorted(p.name for p in version.parent.iterdir() if not p.name.startswith(".")) == ["v0001"]


def test_the_summary_says_the_context(tmp_path, capsys):
    """The build's last lines: tokens per sequence and sequences, and where the values were derived, why."""
    version = build(compose_config(f"output_root={tmp_path}", "stages=[export]", "kv.max_seqs=2", "kv.max_step_tokens=8"))
    out = capsys.readouterr().out
    summary = out[out.index(f"built {version}"):].splitlines()
    assert summary[-3:] == [
        "  context: 128 tokens per sequence x kv.max_seqs=2; prompts in steps of up to 8 tokens",
        "    kv.capacity=128 (null in the config): the layout's default for a model without a context of its own "
        "(model.context_length=0)",
        "  KV cache (float32): 154.6 KB, 77.3 KB a sequence, 1.0 KB a token"]
    recorded = (version / ".hydra" / "config.yaml").read_text()  # the values built, for a rebuild
    assert "capacity: 128" in recorded and "max_step_tokens: 8" in recorded


def test_failed_build_leaves_no_version(tmp_path, monkeypatch):
    import pytest

    from conftest import compose_config
    from pipeline.stages import lower_kv, validate

    def broken(*args, **kwargs):
        raise validate.ValidationFailed("validation failed: forced")

    monkeypatch.setattr(lower_kv, "run", broken)  # a stage after the first fails: any stage is the same
    with pytest.raises(validate.ValidationFailed):
        build(compose_config(f"output_root={tmp_path}", "backend=portable", "model=tiny_flat"))
    exp = tmp_path / "default"
    assert [p.name for p in exp.iterdir()] == [".failed"]
    assert [p for p in (tmp_path / ".cache" / "lower_kv").iterdir() if p.is_dir()] == []  # no entry of the failed stage


def _episode(version):
    return json.loads((version / "validation.json").read_text())


def test_batched_sequence_build(build_dir):
    version = build_dir(*BATCHED)
    kv = json.loads((version / "manifest.json").read_text())["target"]
    assert (kv["layout"], kv["max_seqs"], kv["max_segments"], kv["causal"]) == ("batched-sequence", 4, 8, True)
    report = _episode(version)
    assert report["passed"] and report["max_relative_error"] < 1e-5
    scenario = report["scenario"]
    assert scenario["max_live"] == 4 and len(scenario["sequences"]) == 5 and scenario["mixed_steps"] > 0
    assert max(s["prompt_tokens"] + s["decoded"] for s in scenario["sequences"]) > kv["layers"][0]["rows"], "rings wrap"


def _step_method_ops(program) -> dict:
    """Operator name -> instructions of the step method in a .pte."""
    import collections

    from executorch.exir._serialize._program import deserialize_pte_binary

    prog = deserialize_pte_binary(program.read_bytes())
    prog = getattr(prog, "program", prog)
    plan = next(p for p in prog.execution_plan if p.name == "target_forward_from_embeddings")
    names = [o.name + (f".{o.overload}" if o.overload else "") for o in plan.operators]
    return collections.Counter(names[i.instr_args.op_index] for chain in plan.chains for i in chain.instructions
                               if hasattr(i.instr_args, "op_index"))


@pytest.mark.parametrize("overrides", [(), BATCHED, CELL], ids=["sequence-xnnpack", "batched-sequence", "cell"])
def test_store_writes_are_in_place(build_dir, overrides):
    """Every layer writes its K and V stores with index_put_ into the program's buffer: no functional
    index_put (a copy of the whole store) and no copy_ writing it back, per layer and step. build.json
    records the backend's partitions per method (XNNPACK's; portable has none)."""
    version = build_dir(*overrides)
    ops = _step_method_ops(version / "model.pte")
    manifest = json.loads((version / "manifest.json").read_text())
    assert ops["aten::index_put_"] == 2 * len(manifest["target"]["layers"]), ops
    assert not ops["aten::index_put.out"] and not ops["aten::copy_"], ops
    partitions = json.loads((version / "build.json").read_text())["partitions"]
    assert set(partitions) == {"embed_text", "target_forward_from_embeddings"} and partitions["embed_text"] == 0
    assert (partitions["target_forward_from_embeddings"] > 0) == (manifest["backend"] == "xnnpack"), partitions


def test_cell_build(build_dir):
    version = build_dir(*CELL)
    kv = json.loads((version / "manifest.json").read_text())["target"]
    assert (kv["layout"], kv["max_seqs"], kv["max_segments"]) == ("cell", 3, 6)
    report = _episode(version)
    assert report["passed"] and report["scenario"]["max_live"] == 3


def planned_stores(pte) -> dict:
    """KV store tensors as planned in the .pte: method -> {name: (bytes, mem_id, offset)}."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(pte.read_bytes())
    program = getattr(program, "program", program)
    item = {6: 4, 15: 2, 5: 2, 1: 1}  # ScalarType FLOAT, BFLOAT16, HALF, CHAR (int8)
    planned = {}
    for plan in program.execution_plan:
        stores = {}
        for value in plan.values:
            info = getattr(value.val, "extra_tensor_info", None)
            name = getattr(info, "fully_qualified_name", None)
            if name and name.startswith("kv_store."):
                t = value.val
                n = 1
                for s in t.sizes:
                    n *= s
                alloc = t.allocation_info
                stores[name] = (n * item[int(t.scalar_type)], alloc.memory_id, alloc.memory_offset_low)
        if stores:
            planned[plan.name] = stores
    return planned


# tests/kv/test_int8.py's build: 8-bit stores and their scales
INT8 = ("kv=sequence", "kv.max_seqs=3", "kv.dtype=int8", "validate.decode_steps=16", "experiment_name=kv8")


def test_kv_bytes_match_planned_stores(build_dir):
    for overrides in ((), BATCHED, CELL, INT8):
        version = build_dir(*overrides)
        record = json.loads((version / "build.json").read_text())
        planned = planned_stores(version / "model.pte")
        assert set(planned) == {"target_forward_from_embeddings"}
        forward = planned["target_forward_from_embeddings"]
        assert sum(b for b, _, _ in forward.values()) == record["kv_bytes_total"]
        want = record["models"]["target"]["kv_bytes_per_layer"]
        assert [sum(forward[f"kv_store.{name}_{i}"][0] for name in ("k", "v", "k_scale", "v_scale")
                    if f"kv_store.{name}_{i}" in forward) for i in range(len(want))] == want
        assert any("scale" in name for name in forward) == ("kv.dtype=int8" in overrides)


def test_bf16_build_records_its_weights(tmp_path):
    """The build record hashes the weights of any dtype (numpy has no bfloat16)."""
    from conftest import compose_config

    version = build(compose_config(f"output_root={tmp_path}", "model.dtype=bfloat16", "kv.dtype=bfloat16",
                                   "stages=[export,lower_kv]"))
    record = json.loads((version / "build.json").read_text())
    assert len(record["inputs"]["target"]) == 64


def test_ring_only_model_past_capacity(build_dir):
    """Ring layers only: no flat layer bounds a sequence, so the ring keeps window + step - 1 rows
    whatever kv.capacity says, and the episode's sequences run past capacity against the oracle."""
    version = build_dir("model.layer_pattern=R", "kv.capacity=20", "backend=portable", "experiment_name=ring")
    kv = json.loads((version / "manifest.json").read_text())["target"]
    assert kv["max_seq_len"] is None and {layer["rows"] for layer in kv["layers"]} == {31}
    report = _episode(version)
    assert report["passed"] and max(s["prompt_tokens"] + s["decoded"] for s in report["scenario"]["sequences"]) > 20


def test_live_build_is_not_debris(tmp_path):
    """A build in progress holds its lock: another build in the same directory leaves it alone."""
    from pipeline.build.versions import WorkDir, remove_debris

    with WorkDir(tmp_path) as work:
        assert remove_debris(tmp_path) == [] and work.is_dir()
    # the build ended without publishing or moving its directory to .failed: now that is debris too
    orphan = tmp_path / ".building-deadbeef"  # no lock at all
    orphan.mkdir()
    assert sorted(remove_debris(tmp_path)) == sorted([work, orphan])
    assert list(tmp_path.iterdir()) == []


def test_long_stage_shows_signs_of_life(capsys):
    import time

    from pipeline.build.runner import _heartbeat

    out = ""
    with _heartbeat("compile", every=0.02):
        deadline = time.time() + 30  # a loaded machine may starve the thread for a while
        while out.count("still running") < 3 and time.time() < deadline:
            time.sleep(0.05)
            out += capsys.readouterr().out
    assert "compile: still running, 0 s" in out and out.count("still running") >= 3
    capsys.readouterr()
    time.sleep(0.2)
    assert "still running" not in capsys.readouterr().out, "the heartbeat stops with the stage"


def test_dry_run_plans_from_the_config_alone(tmp_path, build_dir, capsys):
    """dry_run=true: each stage cached or why it would build, each model's weights and KV bytes (the
    built artifact's, to the byte) and the memory estimate, in a second, nothing written."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", f"output_root={tmp_path}", "draft=dflash", "vision=smolvlm_tiny",
                           "kv.max_seqs=4", "dry_run=true"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "[2/5] export: would build: not in the cache" in proc.stdout
    assert "draft  dflash: 0.05 M weights" in proc.stdout and "non-causal: 131072 bytes (0.13 MB) over 1 layers" in proc.stdout
    assert "vision smolvlm_tiny" in proc.stdout and "build peak memory: an estimated" in proc.stdout
    assert list(tmp_path.iterdir()) == []
    version = build_dir()  # the default build, in its own output_root
    record = json.loads((version / "build.json").read_text())
    where = (f"output_root={version.parent.parent}", f"cache_dir={record['cache_dir']}")
    capsys.readouterr()
    assert build(compose_config(*where, "dry_run=true")) is None
    out = capsys.readouterr().out
    assert re.findall(r"\[\d/5\] (\w+): cached", out) == ["export_vision", "export", "lower_kv", "compile", "validate"]
    assert f"causal: {record['kv_bytes_total']} bytes" in out  # the dry run's KV bytes are the artifact's
    assert build(compose_config(*where, "dry_run=true", "kv.max_seqs=2")) is None
    assert "[3/5] lower_kv: would build: changed since v0001: kv.max_seqs 1 -> 2" in capsys.readouterr().out
    refused = subprocess.run([sys.executable, "-m", "pipeline", f"output_root={tmp_path}", "kv.max_seqs=1000000", "dry_run=true"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "over the budget" in refused.stderr  # the budget holds in a dry run too


def test_rebuild_from_the_recorded_config_is_byte_identical(tmp_path):
    """rebuild=<version>: the config the version records builds the next version, every stage anew,
    and its build.json says whether the program's bytes are the same; a differing hash is seen."""
    from pipeline.build.rebuild import rebuild
    from pipeline.build.versions import compare_programs

    first = build(compose_config(f"output_root={tmp_path}", "model=tiny_flat", "backend=portable",
                                 "stages=[export,lower_kv,compile]"))
    second = rebuild(first)
    assert second.name == "v0002" and second.parent == first.parent
    record = json.loads((second / "build.json").read_text())
    assert record["reproduction"] == {"of": str(first), "artifacts": {"model.pte": "identical"}, "identical": True}
    assert {e["from"] for e in record["stage_entries"].values()} == {"built"}  # not from the cache
    record["artifacts"]["model.pte"]["sha256"] = "0" * 64
    assert compare_programs(first, record) == {"of": str(first), "artifacts": {"model.pte": "differs"}, "identical": False}
    proc = subprocess.run([sys.executable, "-m", "pipeline", f"rebuild={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "is not a version directory" in proc.stderr
