"""``python -m pipeline.serve``'s refusals: one line, exit 2, before serving anything (its exit 4, when a dead
engine's restarts are spent, is test_worker.py's)."""

import subprocess
import sys

from conftest import BATCHED


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.serve", *args], capture_output=True, text=True, timeout=300)


def test_a_directory_that_is_not_an_artifact_is_refused(tmp_path):
    out = serve(str(tmp_path))
    assert out.returncode == 2 and "is not a built artifact (no manifest.json)" in out.stderr


def test_an_artifact_without_a_tokenizer_is_refused(build_dir):
    out = serve(str(build_dir(*BATCHED)))
    assert out.returncode == 2 and "has no tokenizer, and the server takes text" in out.stderr, out.stderr[-2000:]


def test_bad_flags_are_refused(tmp_path):
    out = serve(str(tmp_path), "--max-queue", "-1")
    assert out.returncode == 2 and "--max-queue=-1 must be >= 0" in out.stderr


def test_a_negative_number_of_engine_restarts_is_refused(tmp_path):
    out = serve(str(tmp_path), "--engine-restarts", "-1")
    assert out.returncode == 2 and "--engine-restarts=-1 must be >= 0" in out.stderr


def test_the_prefix_cache_is_on_unless_no_prefix_cache_is_given():
    from pipeline.serve.__main__ import parse

    assert parse(["artifact"]).prefix_cache is True
    assert parse(["artifact", "--no-prefix-cache"]).prefix_cache is False


def test_the_prefill_chunk_defaults_to_32_and_0_lifts_the_cap(tmp_path):
    from pipeline.serve.__main__ import DEFAULT_PREFILL_CHUNK, parse

    assert DEFAULT_PREFILL_CHUNK == 32 and parse(["artifact"]).prefill_chunk == 32
    assert parse(["artifact", "--prefill-chunk", "0"]).prefill_chunk is None  # the whole width the decodes leave
    assert parse(["artifact", "--prefill-chunk", "16"]).prefill_chunk == 16
    out = serve(str(tmp_path), "--prefill-chunk", "-1")
    assert out.returncode == 2 and "--prefill-chunk=-1 must be >= 1, or 0" in out.stderr
