"""validate's episode on the default backend at eight sequences: the gathered attention (each query over
its own sequence's rows or cells, a prefill chunk's rows once) held to the eager oracle with independent
per-sequence caches, prompts of unequal lengths, the longest sequence at the capacity, nine sequences
through eight (the ninth takes a released sequence's rows or cells)."""

import json
import shutil

import pytest

# 9 prompts of unequal lengths; with 40 decode steps the longest reaches kv.capacity=96
PROMPTS = "validate.prompt_lengths=[3,30,17,44,9,51,22,38,56]"
LAYOUTS = {
    "batched-sequence": ("kv=sequence", "kv.capacity=96"),
    # the pool holds the eight longest live together (587 tokens)
    "cell": ("kv=cell", "kv.capacity=600"),
    # the native CPU attention (kv.cpu_kernel=native) held by the same episode (it needs g++: below)
    "batched-sequence native": ("kv=sequence", "kv.capacity=96", "kv.cpu_kernel=native"),
    "cell native": ("kv=cell", "kv.capacity=600", "kv.cpu_kernel=native"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_eight_sequences_near_capacity_match_the_oracle(build_dir, name):
    if name.endswith("native") and shutil.which("g++") is None:
        pytest.skip("kv.cpu_kernel=native is built with g++: none here")
    version = build_dir(*LAYOUTS[name], "kv.max_seqs=8", "kv.max_step_tokens=16", PROMPTS,
                        f"experiment_name=episode8_{name.replace(' ', '_')}")
    report = json.loads((version / "validation.json").read_text())
    manifest = json.loads((version / "manifest.json").read_text())
    assert manifest["backend"] == "xnnpack" and manifest["target"]["attention"] == "gather"
    assert manifest["target"]["layout"] == name.removesuffix(" native") and manifest["target"]["max_seqs"] == 8
    assert manifest["target"].get("cpu_kernel", "aten") == ("native" if name.endswith("native") else "aten")
    assert report["passed"] and report["max_relative_error"] < 1e-5
    scenario = report["scenario"]
    assert len(scenario["sequences"]) == 9 and scenario["max_live"] == 8 and scenario["mixed_steps"] > 0
    totals = [s["prompt_tokens"] + s["decoded"] for s in scenario["sequences"]]
    assert max(totals) >= 90 and len(set(totals)) > 5, totals  # near the capacity of 96, lengths unequal
    assert len(report["per_sequence"]) == 9
