"""Fixtures compose the real config tree (conf/) and build real artifacts once per session; the tests
(tests/, mirroring pipeline/) and the benchmarks' own checks (bench/test_*.py) share them."""

import os
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from pipeline.config import register

CONF = str(Path(__file__).resolve().parent / "conf")
register()
warnings.filterwarnings("ignore", category=FutureWarning)


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    """Build a config once per test session, each in its own output root, all through one stage cache;
    returns the version directory."""
    from pipeline.build.runner import build

    built = {}
    cache = tmp_path_factory.mktemp("stage_cache")  # one stage cache: configs of one model share its export

    def _build(*overrides: str) -> Path:
        if overrides not in built:
            root = tmp_path_factory.mktemp("outputs")
            built[overrides] = build(compose_config(f"output_root={root}", f"cache_dir={cache}", *overrides))
        return built[overrides]

    return _build


# Layouts the layout tests build; portable compiles fastest (no delegate partitioning).
BATCHED = ("kv=sequence", "kv.max_seqs=4", "backend=portable", "experiment_name=batched4")
CELL = ("kv=cell", "kv.max_seqs=3", "backend=portable", "experiment_name=cell3")
# The artifact of issue 12's first command: target, DFlash draft and vision encoder, four sequences, XNNPACK.
DRAFT_VISION = ("draft=dflash", "vision=smolvlm_tiny", "kv=sequence", "kv.max_seqs=4", "experiment_name=full4")


def pytest_collection_modifyitems(config, items):
    budgets = os.environ.get("SDPA_VARLEN_BUDGETS_OUT")
    if budgets:  # bench/gpu_suite.sh: each collected test's compile budget, to balance its shards
        with open(budgets, "w") as f:
            for item in items:
                marker = item.get_closest_marker("compiles")
                f.write(f"{marker.args[0] if marker else 0} {item.nodeid}\n")
    if os.environ.get("RUN_SLOW"):
        return
    skip = pytest.mark.skip(reason="slow (a real model's build): RUN_SLOW=1 runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


_CHILD_RESULTS: dict[str, dict] = {}


def run_in_fresh_process(test_file: str, env: dict | None = None) -> dict[str, tuple[str, str]]:
    """A test module's tests in a fresh interpreter process (Triton's interpreter: other modules' use of
    Inductor in the same process breaks its patching of triton.language): {test name: (outcome,
    message)} from its JUnit report. The child sees ``SDPA_VARLEN_FRESH_PROCESS=1`` and runs them."""
    import subprocess
    import sys
    import tempfile
    import xml.etree.ElementTree as ET

    env = dict(os.environ, TRITON_INTERPRET="1", SDPA_VARLEN_FRESH_PROCESS="1", **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                              test_file], env=env, capture_output=True, text=True)
        if not os.path.exists(report):
            raise RuntimeError(f"the fresh process wrote no report: {res.stdout[-2000:]}{res.stderr[-2000:]}")
        results = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            bad = next((c for c in case if c.tag in ("failure", "error")), None)
            skipped = case.find("skipped")
            if bad is not None:
                results[case.get("name")] = ("failed", (bad.get("message") or "") + "\n" + (bad.text or "")[-3000:])
            elif skipped is not None:
                results[case.get("name")] = ("skipped", skipped.get("message") or "")
            else:
                results[case.get("name")] = ("passed", "")
    return results


def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``in_child_process(run=...)`` reports what the child process gave it: ``run()``
    runs the module's tests once in a process of their own -> {test name: (outcome, message)}."""
    marker = pyfuncitem.get_closest_marker("in_child_process")
    if marker is None:
        return None
    module = str(pyfuncitem.path)
    if module not in _CHILD_RESULTS:
        _CHILD_RESULTS[module] = marker.kwargs["run"]()
    outcome, message = _CHILD_RESULTS[module].get(pyfuncitem.name, ("missing", "the child process did not report it"))
    if outcome == "passed":
        return True
    if outcome == "skipped":
        pytest.skip(f"in the child process: {message}")
    pytest.fail(f"in the child process ({outcome}): {message}", pytrace=False)


def gguf_metadata(w, values: dict) -> None:
    """Write {key: value} to a GGUFWriter by the value's Python type (floats as float32, ints as uint32); None: skipped."""
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_uint32(key, value)


def gguf_writer(path: Path, arch: str, *, n_layers: int, dim: int, hidden_dim: int, n_heads: int, n_kv_heads: int,
                norm_eps: float, rope_base: float, vocab_size: int):
    """A gguf.GGUFWriter for ``arch`` with llama.cpp's decoder metadata written."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_rope_freq_base(rope_base)
    w.add_vocab_size(vocab_size)
    return w
