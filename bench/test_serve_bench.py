"""The serving benchmark's own checks (``bench/serve.py``, ``_load.py``, ``_serve_report.py``,
``_results.py``, ``smollm2_contexts.py``), without a server: the percentiles and a row's summary, the
tables and their ratios, the prompts' lengths by SmolLM2's tokenizer, the refusals of a server or an
artifact too small for the run, where llama-server is found, the section written in place."""

import math
import os
from pathlib import Path

import _serve_report  # bench/ is on the path as this file's folder (pytest's rootdir-less import)
import pytest
import serve
import smollm2_contexts

from _load import Result, percentile, summarize
from _results import write_section


def test_percentile_is_the_nearest_rank():
    values = list(range(20, 0, -1))  # unsorted on purpose
    assert percentile(values, 0.5) == 10
    assert percentile(values, 0.95) == 19
    assert percentile(values, 1.0) == 20
    assert percentile([7.0], 0.95) == 7.0
    assert math.isnan(percentile([], 0.5))


def test_summarize_counts_finished_requests_only():
    done = Result(ok=True, finish_reason="length", ttft=0.1, gaps=[0.01, 0.03], tokens=3, prompt_tokens=130, cached_tokens=2)
    short = Result(ok=True, finish_reason="stop", ttft=0.3, gaps=[0.02], tokens=2, prompt_tokens=132)
    hung_up = Result(ok=True, disconnected=True, ttft=0.2, gaps=[9.0], tokens=1)
    failed = Result(error="503 queue full")
    row = summarize([done, short, hung_up, failed], wall=2.0)
    assert (row["requests"], row["errors"], row["tokens"]) == (2, 1, 5)
    assert row["tok_s"] == 2.5 and row["req_s"] == 1.0 and row["tokens_per_request"] == 2.5
    assert (row["ttft_p50"], row["ttft_p95"]) == (0.1, 0.3)
    assert (row["itl_p50"], row["itl_p95"]) == (0.02, 0.03)  # the hung-up request's gap is not among them
    assert (row["prompt_tokens"], row["cached_tokens"]) == (131, 2)


def _row(tok_s: float, ttft: float = 0.5, itl: float = 0.01, prompt: float | None = 130) -> dict:
    return {"tok_s": tok_s, "req_s": 1.0, "ttft_p50": ttft, "ttft_p95": ttft, "itl_p50": itl, "itl_p95": itl,
            "tokens_per_request": 128.0, "prompt_tokens": prompt, "cached_tokens": 0, "errors": 0}


def test_tables_divide_ours_by_llama_server():
    table = {"ours a": {(130, 1): _row(200, ttft=0.1, itl=0.005), (770, 16): _row(90, ttft=0.6)},
             "llama-server": {(130, 1): _row(100, ttft=0.4, itl=0.01), (770, 16): _row(0)}}
    rows = _serve_report.rows_table(table)
    assert rows[2].startswith("| ours a | 130 | 1 | 200.0 | 2.00 | ")
    assert rows[3].startswith("| ours a | 770 | 16 | 90.0 | - | ")  # the peer's 0 tok/s: no ratio
    assert "| 130 / 0 |" in rows[2]
    ratios = _serve_report.ratio_table(table, ["ours a", "ours b"])
    assert ratios[0] == "| prompt | clients | ours a: tok/s | TTFT p50 | ITL p50 | ours b: tok/s | TTFT p50 | ITL p50 |"
    assert ratios[2] == "| 130 | 1 | 2.00 | 0.25 | 0.50 | - | - | - |"
    assert ratios[3] == "| 770 | 16 | - | 1.20 | 1.00 | - | - | - |"
    assert len({line.count("|") for line in ratios}) == 1
    assert _serve_report.memory_table({"llama-server": {"ready": 315.2, "end": 346.0}})[2] == "| llama-server | 315 | 346 |"
    assert _serve_report.engine_table({"ours a": 100.0}, table, (130, 1))[2] == "| ours a | 100.0 | 200.0 | 2.00 |"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(serve.GGUF.parent), gguf_file=serve.GGUF.name)


def test_prompts_have_their_lengths_and_are_distinct(tokenizer):
    assert len(tokenizer(serve.PASSAGE).input_ids) >= 770 + 20  # the default lengths need the passage once, no repeats
    sets = serve.prompt_sets(tokenizer, [130, 770], [1, 16])
    assert [len(texts) for texts in sets.values()] == [4, 32, 4, 32]
    every = [text for texts in sets.values() for text in texts]
    assert len(set(every)) == len(every)
    for (n, _), texts in sets.items():
        assert all(abs(len(tokenizer(t).input_ids) - n) <= 2 for t in texts), n
    with pytest.raises(ValueError, match="--prompt-tokens 5000"):
        serve.prompts(tokenizer, 5000, ["x"])


def test_a_server_too_small_for_the_run_is_refused():
    serve.check_capacity("a (kv.capacity)", 1024, 770, 128)
    serve.check_capacity("ring layers only", None, 770, 128)
    with pytest.raises(SystemExit, match="a holds 512 tokens a sequence; the 770-token prompts plus --max-tokens 128 need 898"):
        serve.check_capacity("a", 512, 770, 128)
    kv = {"max_seq_len": 1024, "max_seqs": 8}
    smollm2_contexts.check_artifact(Path("v"), {"max_seq_len": 1048, "max_seqs": 8}, [64, 1024], [1, 8], 24)
    with pytest.raises(SystemExit, match="its kv.capacity is 1024 tokens a sequence; a 1024-token context plus --steps 24 needs 1048"):
        smollm2_contexts.check_artifact(Path("v"), kv, [64, 256, 1024], [1, 8], 24)
    with pytest.raises(SystemExit, match="its kv.max_seqs is 4; --seqs 8"):
        smollm2_contexts.check_artifact(Path("v"), kv | {"max_seqs": 4}, [64], [1, 8], 24)


def test_llama_server_comes_from_the_option_the_environment_or_the_shared_build(tmp_path, monkeypatch):
    binaries = {}
    for name in ("option", "env", "shared"):
        binaries[name] = tmp_path / name
        binaries[name].write_text("#!/bin/sh\n")
        binaries[name].chmod(0o755)
    monkeypatch.setattr(serve, "SHARED_LLAMA_SERVER", binaries["shared"])
    monkeypatch.setenv("LLAMA_SERVER", str(binaries["env"]))
    assert serve.llama_server_path(str(binaries["option"])) == binaries["option"]
    assert serve.llama_server_path(None) == binaries["env"]
    monkeypatch.delenv("LLAMA_SERVER")
    assert serve.llama_server_path(None) == binaries["shared"]
    monkeypatch.setattr(serve, "SHARED_LLAMA_SERVER", tmp_path / "absent")
    with pytest.raises(SystemExit, match="no llama-server: pass --llama-server PATH or set LLAMA_SERVER"):
        serve.llama_server_path(None)
    with pytest.raises(SystemExit, match=f"{tmp_path / 'absent'} is not an executable file"):
        serve.llama_server_path(str(tmp_path / "absent"))


def test_quick_is_a_small_run_written_elsewhere():
    args = serve.parse_args(["--artifacts", "a", "--quick"])
    assert (args.clients, args.max_tokens, args.prompt_tokens) == ([1, 2], 16, [130])
    assert args.out.parent.is_dir() and not str(args.out).startswith(str(serve.REPO / "docs"))
    os.rmdir(args.out.parent)
    full = serve.parse_args(["--artifacts", "a"])
    assert (full.clients, full.max_tokens, full.prompt_tokens, full.out) == ([1, 4, 8, 16], 128, [130, 770], None)


def test_a_section_is_rewritten_in_place(tmp_path):
    path = tmp_path / "benchmarks.md"
    write_section("other", "kept", path)
    write_section("serve", "first", path)
    write_section("serve", "second", path)
    text = path.read_text()
    assert "<!-- other -->\nkept\n<!-- /other -->" in text
    assert "<!-- serve -->\nsecond\n<!-- /serve -->" in text and "first" not in text
