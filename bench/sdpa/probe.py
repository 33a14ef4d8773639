"""Where a small decode's time goes: our kernel beside *ablations* of it and the peers, same run.

    PYTHONUNBUFFERED=1 python -m bench.sdpa.probe [--warm I/N] [--out PATH] [--ncu-run]

An ablation is the kernel package with one named edit of its source (``EDITS``: the merge skipped,
no keys read, the record read and nothing else, ...), written to ``.whl/probe/<name>/`` (ignored) and
loaded beside ours (``versions.load_module``). Ablations give wrong outputs on purpose: they time a part
of the work (a time with the merge skipped, against ours, is what the merge costs); variants that only
change ``Tuning`` or a schedule are checked against ours' output first (``ok`` column). Each case's
rows are timed in two alternating rounds, the lower kept, beside padded SDPA and ExecuTorch's Triton
SDPA on the same case.

``--warm I/N`` compiles shard I of N of the variants (run once each, untimed) so that N processes fill
Triton's cache side by side before the timing process, whose compiles then hit the cache.
``--ncu-run`` runs ours, the no-merge ablation, the fused decode merge and the peers on the first case eagerly inside an NVTX
range ``probe`` for Nsight Compute (``ncu --nvtx --nvtx-include probe/``)."""

import argparse
import functools
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from bench.sdpa import peers
from bench.sdpa.ours import ours_calls
from bench.sdpa.removed import MODULES, PACKAGE, REPO
from bench.sdpa.timing import log, n_rot, time_fn
from bench.sdpa.versions import load_module
from bench.sdpa.workloads import HEADS, Work, lognormal_lengths
from pipeline.kernels import sdpa_varlen as K

PROBE_DIR = REPO / ".whl" / "probe"
HQ, HKV, D = HEADS[0]

# named edits of the kernel package's source: (module, old, new, count): old must occur exactly count times
EDITS = {
    "no merge": [("attention.py", "            if nsplit <= MERGE_GROUP:  # one level",
                  "            if nsplit > 0:  # probe: partials written, never merged\n                pass\n"
                  "            elif nsplit <= MERGE_GROUP:  # one level", 1),
                 ("attention.py", "        if paths == 3 and merge_launch:", "        if False:  # probe: no merge launch", 1)],
    "no keys": [("attention.py", "    kend = tl.load(rp + F_KEND)", "    kend = tl.load(rp + F_KSTART)  # probe: no keys", 1)],
    "record only": [("attention.py", "    if p < n_items:", "    if p + (1 << 30) < n_items:  # probe: nothing past the record",
                     1)],
    "no partial reads": [("merge.py", "    for s0 in range(0, ns, SPL):",
                                 "    for s0 in range(0, ns * 0, SPL):  # probe: no partial read", 1)],
    "relaxed tickets": [("attention.py", 'sem="acq_rel"', 'sem="relaxed"', 2),
                        ("merge.py", 'sem="acq_rel"', 'sem="relaxed"', 1)],
}
EDITS["no keys, no merge"] = EDITS["no keys"] + EDITS["no merge"]

# (row name, Tuning fields, edit name or None).  A row with an edit is an ablation: wrong outputs on purpose
# (relaxed tickets: no ordering of the partials before the merge's reads); the others are checked against ours
VARIANTS = [
    ("ours (defaults)", {}, None),
    ("fused decode merge", dict(dec_merge_launch=False), None),
    ("decode merge launch, 8 programs", dict(dec_merge_split=8), None),
    ("decode merge launch, 1 program", dict(dec_merge_split=1), None),
    ("min_chunk 512", dict(min_chunk=512), None),
    ("no merge", {}, "no merge"),
    ("no partial reads", {}, "no partial reads"),
    ("fused, relaxed tickets", dict(dec_merge_launch=False), "relaxed tickets"),
    ("no keys", {}, "no keys"),
    ("no keys, no merge", {}, "no keys, no merge"),
]


def cases() -> list[Work]:
    lens16 = lognormal_lengths(16, 8192, 4 * 8192)  # the sweep's skewed case
    return [Work("decode B=1 L=8k", HQ, HKV, D, [(8192, 1, 0)], True),
            Work("decode B=1 L=32k", HQ, HKV, D, [(32768, 1, 0)], True),
            Work("decode B=4 L=2k", HQ, HKV, D, [(2048, 1, 0)] * 4, True),
            Work("decode B=16 L=8k", HQ, HKV, D, [(8192, 1, 0)] * 16, True),
            Work("skewed B=16 L~8k", HQ, HKV, D, [(n, 1, 0) for n in lens16], True, rows=max(lens16)),
            Work("decode B=64 L=2k", HQ, HKV, D, [(2048, 1, 0)] * 64, True),
            Work("draft16 B=4 L=8k", HQ, HKV, D, [(8192, 16, 0)] * 4, False)]


def edited_package(edit: str) -> str:
    """The kernel package with ``EDITS[edit]`` applied, in ``.whl/probe/<edit>/``."""
    src = REPO / PACKAGE
    dest = PROBE_DIR / re.sub(r"\W", "_", edit)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in MODULES + ("layout.py",):
        shutil.copy(src / name, dest / name)
    for module, old, new, count in EDITS[edit]:
        text = (dest / module).read_text()
        if text.count(old) != count:
            raise ValueError(f"probe edit {edit!r}: {old!r} occurs {text.count(old)} times in {module}, not {count}")
        (dest / module).write_text(text.replace(old, new))
    return str(dest)


@functools.cache
def edited_module(edit: str):
    """The edited package, loaded once (its compiled kernels kept for every case)."""
    return load_module(edited_package(edit), "probe_" + re.sub(r"\W", "_", edit))


def variant_calls(w: Work, inputs, fields: dict, edit: str | None):
    """The variant's calls on w (one per K/V copy)."""
    if edit is None:
        fns, _, _ = ours_calls(w, tuning=K.Tuning(**fields), inputs=inputs)
        return fns
    mod = edited_module(edit)
    fns, _, _ = ours_calls(w, mod=mod, tuning=mod.Tuning(**fields), inputs=inputs)
    return fns


def run(shard: tuple[int, int] | None) -> list[str]:
    rows = {}
    mine = [v for i, v in enumerate(VARIANTS) if shard is None or i % shard[1] == shard[0]]
    for w in cases():
        inputs = w.ours_inputs(n_rot(w.kv_read))
        ref = ours_calls(w, inputs=inputs)[0][0]()
        calls = {}
        for name, fields, edit in mine:
            try:
                fns = variant_calls(w, inputs, fields, edit)
                out = fns[0]()
                err = (out.float() - ref.float()).abs().max().item()
                ok = "ablation" if edit else ("yes" if err < 2e-2 else f"NO ({err:.2e})")
                calls[name] = (fns, ok)
            except Exception as e:  # noqa: BLE001  (reported in the row)
                rows[w.name, name] = f"err {type(e).__name__}: {str(e)[:100]}"
                log(f"{w.name} | {name}: {rows[w.name, name]}")
        if shard is not None:
            continue
        best = {}
        for _ in range(2):  # alternating rounds, the lower kept
            for name, (fns, _) in calls.items():
                best[name] = min(best.get(name, math.inf), time_fn(fns))
        for name, (_, ok) in calls.items():
            rows[w.name, name] = f"{best[name]:.1f} ({ok})"
            log(f"{w.name} | {name}: {rows[w.name, name]}")
        for peer, fn in (("padded SDPA", peers.run_sdpa), ("ExecuTorch SDPA", peers.run_et)):
            try:
                us, note = fn(w)
                rows[w.name, peer] = f"{us:.1f}" if us is not None else note
            except Exception as e:  # noqa: BLE001
                rows[w.name, peer] = f"err {type(e).__name__}"
            log(f"{w.name} | {peer}: {rows[w.name, peer]}")
        torch.cuda.empty_cache()
    names = [v[0] for v in VARIANTS] + ["padded SDPA", "ExecuTorch SDPA"]
    head = "| variant (µs per call; ok: output as ours') | " + " | ".join(w.name for w in cases()) + " |"
    lines = [head, "|---|" + "---:|" * len(cases())]
    lines += [f"| {n} | " + " | ".join(rows.get((w.name, n), "") for w in cases()) + " |" for n in names]
    return lines


def ncu_run() -> None:
    """Ours, the no-merge ablation, the fused decode merge and the peers on the first case, eagerly, after a warm-up, inside
    the NVTX range 'probe' (two calls each)."""
    w = cases()[0]
    inputs = w.ours_inputs(1)
    ours = variant_calls(w, inputs, {}, None)[0]
    nomerge = variant_calls(w, inputs, {}, "no merge")[0]
    fused = variant_calls(w, inputs, dict(dec_merge_launch=False), None)[0]
    sdpa, et = peers.sdpa_parts(w), peers.et_parts(w)
    sdpa_ctx = sdpa.setup()
    calls = [ours, nomerge, fused, lambda: sdpa.layer(sdpa_ctx, 0)]
    if not isinstance(et, str):
        calls.append(lambda: et.layer(None, 0))
    for f in calls:  # compiles and autotuning outside the range
        f(), f()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("probe")
    for f in calls:
        f(), f()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    log("ncu-run order: ours x2, no merge x2, fused decode merge x2, padded SDPA x2"
        + (", ExecuTorch x2" if len(calls) > 4 else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", help="I/N: compile shard I of N of the variants, untimed")
    ap.add_argument("--out", help="write the table (markdown) here")
    ap.add_argument("--ncu-run", action="store_true")
    a = ap.parse_args()
    if a.ncu_run:
        ncu_run()
        return
    shard = tuple(int(x) for x in a.warm.split("/")) if a.warm else None
    lines = run(shard)
    if shard is None:
        gpu = torch.cuda.get_device_name()
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or "(no git here)"
        text = "\n".join([f"- GPU: {gpu}; kernel at {rev}; `{' '.join(sys.argv)}`", "", *lines, ""])
        print(text)
        if a.out:
            Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
