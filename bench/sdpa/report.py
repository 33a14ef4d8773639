"""The markdown report of the GPU benchmark (docs/benchmarks_gpu_sdpa.md): the setup, the
table, the issue's goals marked met or not, numerics, sweep and profile."""

import datetime

import torch
import triton

from .peers import VARLEN_PARAMS, et_decode

# (case name in the table, what is checked, the check on a row) -- issue 15's goals on an H200
GOALS = [
    ("32/8 D128 decode uniform B=1 L=32768", ">= 3.4 TB/s and >= 0.95x SDPA",
     lambda r: _tbs(r) >= 3.4 and _vs(r, "sdpa") >= 0.95),
    ("32/8 D128 decode uniform B=16 L=8192", ">= 0.95x SDPA", lambda r: _vs(r, "sdpa") >= 0.95),
    ("32/8 D128 decode uniform B=64 L=8192", ">= 0.95x SDPA", lambda r: _vs(r, "sdpa") >= 0.95),
    ("32/8 D128 draft 16 non-causal B=4 L=8192", ">= 3.4 TB/s", lambda r: _tbs(r) >= 3.4),
    ("32/8 D128 prefill chunk=2048 hist=8192", ">= 1.0x SDPA and >= 1.3x varlen_attn",
     lambda r: _vs(r, "sdpa") >= 1.0 and _vs(r, "varlen") >= 1.3),
    ("32/8 D128 prefill chunk=8192 hist=0", ">= 0.8x SDPA and >= 1.2x Flex",
     lambda r: _vs(r, "sdpa") >= 0.8 and _vs(r, "flex") >= 1.2),
    ("32/8 D128 decode uniform B=256 L=2048", "plan < 10 µs for 256 sequences", lambda r: (r["plan"] or 1e9) < 10),
]


def _tbs(r):
    return r["tbs"] or 0.0


def _vs(r, peer):
    """peer time / ours (> 1: ours faster); 0 where either is missing."""
    t = r["peers"].get(peer, (None, ""))[0]
    return t / r["ours"] if t and r["ours"] else 0.0


def fmt(us):
    return "—" if us is None else f"{us:,.1f}"


def goals(rows) -> list[str]:
    by_name = {r["name"]: r for r in rows}
    out = ["| goal case | goal | ours µs | TB/s | vs SDPA | vs varlen | vs Flex | plan µs | met |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, text, check in GOALS:
        r = by_name.get(name)
        if r is None or r["ours"] is None:
            out.append(f"| {name} | {text} | not run | | | | | | not measured |")
            continue
        vs = {p: (f"{_vs(r, p):.2f}x" if _vs(r, p) else "—") for p in ("sdpa", "varlen", "flex")}
        out.append(f"| {name} | {text} | {fmt(r['ours'])} | {_tbs(r):.2f} | {vs['sdpa']} | {vs['varlen']} | {vs['flex']} | "
                   f"{fmt(r['plan'])} | "
                   f"{'yes' if check(r) else 'no'} |")
    return out


def markdown(*, cmd, prop, read_tbs, mm_tf, rows, num, compare, sweep, table_tuning, profile, skipped, budget_s, wall_s,
             plan=(), final: bool = True) -> str:
    md = ["# sdpa_varlen (Triton) on GPU", "",
          f"- command: `{cmd}`", f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
          f"- GPU: {prop.name} ({prop.multi_processor_count} SMs), torch {torch.__version__}, triton {triton.__version__}",
          f"- measured ceilings: read {read_tbs:.2f} TB/s (torch.sum over 4 GiB bf16), "
          f"bf16 matmul {mm_tf:.0f} TFLOP/s (8192^3, random data)",
          "- times: µs per call, median over CUDA-graph replays (a call that cannot be captured is an error, "
          "not an eager timing); K/V rotated over several buffers (≥ 150 MB per replay) so reads come from HBM, not L2",
          "- TB/s = (bytes of K/V actually read + Q + O) / our time; TFLOP/s = 4·D·Hq·(visible query-key pairs) / our time",
          "- ours: K/V in the column store [rows·columns, Hkv, D], seq_info describing the runs. 'ours µs' is "
          "one layer's attention (one launch, two where the step holds blocks of more tokens than a short tile's: "
          "the long blocks' launch, skipped where the case's token count rules them out; split blocks merged in it) "
          "along a plan computed beforehand: a lowered "
          "model plans once per step and layer kind (`kvcache::sdpa_varlen_plan`) and every layer of that kind reuses "
          "it; 'plan µs' is that plan alone, per launch of 16 in one graph (what it adds to a step's graph: its kernel "
          "and the gap to the next), to be spread over the layers of a kind",
          "- sdpa: F.scaled_dot_product_attention on padded contiguous [B,H,L,D] (enable_gqa; key-padding mask "
          "for skewed lengths; prefill with history: KV heads repeated + causal_lower_right)",
          "- varlen: torch.nn.attention.varlen.varlen_attn on packed contiguous K/V "
          + ("(enable_gqa)" if "enable_gqa" in VARLEN_PARAMS else "with KV heads repeated (no enable_gqa in this torch)")
          + "; packing not timed",
          "- flex: FlexAttention (torch.compile, block mask) on the few shapes marked; 'not run' elsewhere "
          "(compile per shape does not fit the time)",
          "- et: ExecuTorch Triton SDPA (sdpa_decode_splitk, uniform decode only)"
          + ("" if et_decode is not None else " — n/a: executorch not importable on this machine"),
          f"- ours timed with `{table_tuning}`",
          "- mixed step: sdpa = two calls (the decodes, then the chunk) in one graph",
          "- peers skipped ('mem') where their padded/repeated K/V would pass 30 GB"]
    if compare:
        md.append(f"- prev: the kernel module `{compare}` on the same inputs; with it, ours and prev are each the "
                  "lower of two medians, timed alternately (ours, prev, ours, prev)")
    md += ["", "## Goals (issue 15)", ""] + goals(rows)
    md += ["", "| case | KV GB | ours µs | plan µs | ours TB/s | ours TFLOP/s | sdpa µs | varlen µs | flex µs | et µs | ours/sdpa |"
           + (" prev µs | prev/ours |" if compare else ""),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if compare else "")]
    for r in rows:
        p = r["peers"]

        def cell(k):
            v, note = p.get(k, (None, ""))
            return fmt(v) if v is not None else (note or "—")
        sd = _vs(r, "sdpa")
        md.append(f"| {r['name']} | {r['kv']:.3f} | {fmt(r['ours'])} | {fmt(r['plan'])} | {_tbs(r):.2f} | {r['tf'] or 0:.1f} | "
                  f"{cell('sdpa')} | {cell('varlen')} | {cell('flex')} | {cell('et')} | {f'{sd:.2f}x' if sd else '—'} |"
                  + (f" {fmt(r['prev'])} | {r['prev'] / r['ours']:.2f}x |" if r["prev"] and r["ours"] else
                     (" — | — |" if compare else "")))
    md += ["", "ours/sdpa > 1 means ours is faster.", "",
           "## Numerics (max abs error vs fp32 math SDPA on the same data)", "",
           "| case | ours bf16 | PyTorch SDPA bf16 |", "|---|---:|---:|"]
    md += [f"| {name} | {eo:.2e} | {ep:.2e} |" for name, eo, ep in num]
    if sweep:
        chosen, default, report = sweep
        md += ["", "## Tuning sweep (our kernel; the table above names the Tuning it was timed with)", "",
               f"fastest on the sweep cases: `{chosen}`", "", f"defaults: `{default}`", "",
               "| group, variant | sum of time ratios to the group's first | cases |", "|---|---:|---|"] + report
    if plan:
        md += ["", "## The plan alone (per launch: 16 launches in one graph, and the only launch of a graph, "
               "whose figure holds the graph's launch; each the lower of two medians, timed alternately)", ""] + list(plan)
    if profile:
        md += ["", "## Profile (our kernel, per launch, median µs under torch.profiler; compiled kernel's registers, "
               "spills, shared memory)", ""] + [f"- {x}" for x in profile]
    if skipped:
        md += ["", f"Not run (time budget of {budget_s:.0f} s spent): " + ", ".join(skipped)]
    md += ["", f"Total bench wall time: {wall_s:.0f} s" if final else
           f"**Partial report**: the run had measured the rows above after {wall_s:.0f} s and did not finish."]
    return "\n".join(md) + "\n"
