"""The markdown report of the GPU benchmark (docs/benchmarks_gpu_sdpa.md): the setup, the
per-call table, the model-level step table (``--step``), the issue's goals for each marked met, not
met or not measured, numerics, sweep and profile."""

import datetime

import torch
import triton

from .peers import VARLEN_PARAMS, et_decode

P = "32/8 D128 "
UNI16 = P + "decode uniform B=16 L=8192"

# (case name in the table, what is checked, the check on a row and all rows by name: True, False or None
# where it needs a row that is missing) -- issue 42's goals for the per-call table on an H200
GOALS = [
    (P + "draft 16 non-causal B=4 L=8192", ">= 3.4 TB/s", lambda r, by: _tbs(r) >= 3.4),
    (P + "draft 16 non-causal B=8 L=8192", ">= 3.4 TB/s", lambda r, by: _tbs(r) >= 3.4),
    (P + "prefill chunk=8192 hist=0", ">= 0.9x SDPA and >= 1.2x Flex",
     lambda r, by: _vs(r, "sdpa") >= 0.9 and _vs(r, "flex") >= 1.2),
    (P + "decode skewed B=16 L~8192", "<= 1.10x the time of decode uniform B=16 L=8192",
     lambda r, by: _within(r["ours"], (by.get(UNI16) or {}).get("ours"), 1.10)),
    (P + "prefill chunk=2048 hist=8192", ">= 1.0x SDPA and >= 1.3x varlen_attn",
     lambda r, by: _vs(r, "sdpa") >= 1.0 and _vs(r, "varlen") >= 1.3),
    (P + "decode uniform B=256 L=2048", "plan < 10 µs for 256 sequences", lambda r, by: (r["plan"] or 1e9) < 10),
]


def _tbs(r):
    return r["tbs"] or 0.0


def _vs(r, peer):
    """peer time / ours (> 1: ours faster); 0 where either is missing."""
    t = r["peers"].get(peer, (None, ""))[0]
    return t / r["ours"] if t and r["ours"] else 0.0


def _within(t, base, factor):
    """t <= factor x base; None where base is missing (not measured)."""
    return None if not base or not t else t <= factor * base


def _met(m) -> str:
    return "not measured" if m is None else ("yes" if m else "no")


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
                   f"{_met(check(r, by_name))} |")
    return out


# issue 42's goals for the step table: (case, L, goal, the measured value from a row and all rows by
# (name, L), ">=" or "<=", threshold); a value None (a row or a peer missing) is not measured
def _peer_ratio(r, by):
    return r["ratio"]


def _skew_over_uniform(r, by):
    u = by.get((UNI16, r["layers"]))
    return r["ours"] / u["ours"] if u and u["ours"] and r["ours"] else None


STEP_GOALS = (
    [(P + c, n, "ours per layer <= fastest peer's (peer/ours >= 1.0)", _peer_ratio, ">=", 1.0)
     for c in ("decode uniform B=1 L=32768", "decode uniform B=1 L=8192", "decode uniform B=4 L=2048") for n in (16, 32)]
    + [(P + f"draft 16 non-causal B={b} L=8192", n, ">= 3.4 TB/s", lambda r, by: r["tbs"], ">=", 3.4)
       for b in (4, 8) for n in (16, 32)]
    + [(P + "decode skewed B=16 L~8192", n, "step time <= 1.10x decode uniform B=16 L=8192's (same L)",
        _skew_over_uniform, "<=", 1.10) for n in (16, 32)])


def step_goals(rows: list[dict]) -> list[str]:
    """The step goals marked yes / no / not measured."""
    by = {(r["name"], r["layers"]): r for r in rows}
    out = ["| goal case | L | goal | ours µs/step | ours µs/layer | TB/s | fastest peer | measured | met |",
           "|---|---:|---|---:|---:|---:|---|---:|---|"]
    for name, n, text, value, op, bound in STEP_GOALS:
        r = by.get((name, n))
        v = value(r, by) if r is not None and r["ours"] is not None else None
        met = None if v is None else (v >= bound if op == ">=" else v <= bound)
        if r is None:
            out.append(f"| {name} | {n} | {text} | not run | | | | | not measured |")
            continue
        out.append(f"| {name} | {n} | {text} | {fmt(r['ours'])} | {fmt(r['per_layer'])} | {r['tbs'] or 0:.2f} | "
                   f"{r['fastest'] or '—'} | {'—' if v is None else f'{v:.2f}'} | {_met(met)} |")
    return out


SHORT = ("", "mem", "n/a", "not run", "—")


def _cell(t, note):
    """A side's step time, or why there is none (its first words: the notes column has the rest)."""
    return fmt(t) if t is not None else (note.split(":")[0] if note else "—")


def _notes(r) -> str:
    sides = [("ours", (r["ours"], r["ours_note"]))] + list(r["peers"].items())
    return "; ".join(f"{side}: {note}" for side, (t, note) in sides
                     if note not in SHORT and (t is not None or note != _cell(t, note)))


def step_section(cmd: str, step: dict, budget_s: float) -> list[str]:
    """The model-level step: the command, the method, the table, its goals, the cases not run."""
    rows, flex = step["rows"], step["flex"]
    md = ["", "## Model-level step (a serving model's decode step: L layers of attention)", "",
          f"- command: `{cmd}` (`--step`: after the per-call table, in the same time budget; `--step-only`: alone)",
          "- ours: one step = the plan (`plan_impl`, once) + L `attend_impl` calls along it, as a lowered model does "
          "(`kvcache::sdpa_varlen_plan` once per step, `kvcache::sdpa_varlen_attend` per layer); layer i reads K/V "
          "copy i mod n of the column store, n the per-call table's rotation (≥ 150 MB of K/V per rotation, 3x L2; "
          "one copy where a layer's K/V alone is larger), the same q for every layer",
          "- peers: L calls per step, layer i on copy i mod n of the peer's own layout, with what the peer needs once "
          "per step inside the timed step: sdpa the key-padding mask from a lengths tensor (uniform lengths: none; "
          "mixed: two calls per layer, the decodes and the chunk; a draft block a plain call with Lq=16), varlen "
          "the cu_seqlens (cumulative sums of lengths tensors"
          + ("" if "enable_gqa" in VARLEN_PARAMS else "; KV heads repeated: no enable_gqa in this torch")
          + "), flex create_block_mask (only on: " + ", ".join(sorted(flex)) + "; 'not run' elsewhere: a compile per "
          "shape; a note 'block mask built outside the graph' says its capture failed and it was built once before), "
          "et nothing (uniform decodes only"
          + (")" if et_decode is not None else "; n/a: executorch not importable on this machine)"),
          "- wrapped decodes: the peers' layouts have no rings, their work is the uniform row's: its times (= uniform)",
          "- each side's step is one closure captured in a CUDA graph, median µs per step over replays; a side whose "
          "capture fails says 'capture fails' (never an eager timing); inputs made once per case for every L",
          "- µs/layer = step / L (the plan included); TB/s = L x (one layer's K/V read + Q + O) / step time; "
          "peer/ours = the fastest peer's step time / ours (> 1: ours faster); 'mem': the side's buffers would "
          "pass 30 GB (ours: 60 GB)", "", "### Goals (issue 42)", ""] + step_goals(rows)
    md += ["", "| case | L | KV GB per layer | ours µs/step | ours µs/layer | TB/s | sdpa µs | varlen µs | flex µs | et µs "
           "| fastest peer | peer/ours | notes |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        p = r["peers"]
        cells = " | ".join(_cell(*p.get(k, (None, "—"))) for k in ("sdpa", "varlen", "flex", "et"))
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "—"
        md.append(f"| {r['name']} | {r['layers']} | {r['kv']:.3f} | {_cell(r['ours'], r['ours_note'])} | {fmt(r['per_layer'])} | "
                  f"{r['tbs'] or 0:.2f} | {cells} | {r['fastest'] or '—'} | {ratio} | {_notes(r)} |")
    if step["skipped"]:
        md += ["", f"Step cases not run (time budget of {budget_s:.0f} s spent): " + ", ".join(step["skipped"])]
    return md


def _per_call_table(rows: list[dict], compare: str | None) -> list[str]:
    """The per-call table and its goals."""
    md = ["", "## Goals (issue 42)", ""] + goals(rows)
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
    return md + ["", "ours/sdpa > 1 means ours is faster."]


def markdown(*, cmd, prop, read_tbs, mm_tf, rows, num, compare, sweep, table_tuning, profile, skipped, budget_s, wall_s,
             plan=(), final: bool = True, step: dict | None = None, per_call: bool = True) -> str:
    """The report; step: the step table's rows, cases not run and Flex cases (``--step``), or None;
    per_call False (``--step-only``): no per-call goals, table or numerics."""
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
    if per_call:
        md += _per_call_table(rows, compare)
    if step is not None:
        md += step_section(cmd, step, budget_s)
    if per_call:
        md += ["", "## Numerics (max abs error vs fp32 math SDPA on the same data)", "",
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


def kept_history(path: str) -> str:
    """What an existing report file holds after its report: every top-level section past the first
    (earlier sweeps, the tuning history), kept below the new report when it is rewritten."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return ""
    at = text.find("\n# ", 1)
    return "\n" + text[at:].lstrip("\n") if at >= 0 else ""
