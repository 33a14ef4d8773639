"""The model-level step of the GPU benchmark: what a serving model's decode step spends in attention.
A lowered model computes the plan (``K.plan_impl``) once per step and every layer only attends along it
(``K.attend_impl``): ours is one closure of the plan + L attends, layer i on K/V copy i mod n (the
copies of the per-call table: ≥ 3x L2 per rotation, so reads come from HBM); each peer is L calls
with its per-step setup (mask, cu_seqlens, block mask) inside the step.  Every side is one closure
captured in a CUDA graph (``timing.time_fn``): µs per step."""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from pipeline.kernels import sdpa_varlen as K

from . import peers
from .report import fmt
from .timing import GB, MAX_KV_OURS, log, n_rot, time_fn
from .workloads import Work, build_cases

LAYERS = (16, 32)
STEP_KINDS = ("decode", "skew", "wrap", "draft", "mixed")  # a serving model's steps: no prefill
MIXED = "mixed 128 decodes@2k + 2k chunk"
STEP_FLEX = ("32/8 D128 decode uniform B=16 L=8192", "32/8 D128 decode skewed B=16 L~8192",
             "32/8 D128 draft 16 non-causal B=4 L=8192")  # Flex compiles per shape: only these by default
PEERS: dict[str, Callable[[Work], "peers.Parts | str"]] = {
    "sdpa": peers.sdpa_parts, "varlen": peers.varlen_parts, "flex": peers.flex_parts, "et": peers.et_parts}
OUTSIDE_OK = {"flex": "block mask"}  # setup that may be built outside the graph when its capture fails (said in the note)
CAPTURE = "CUDA-graph capture failed: "  # how time_fn's capture errors start


def case_name(w: Work) -> str:
    return f"{w.hq}/{w.hkv} D{w.d} {w.name}"


# the cases of the step goals first (a run whose time budget is spent keeps them), then the rest in table order
FIRST = ("decode uniform B=1 L=32768", "decode uniform B=1 L=8192", "decode uniform B=4 L=2048",
         "draft 16 non-causal B=4 L=8192", "draft 16 non-causal B=8 L=8192", "decode uniform B=16 L=8192",
         "decode skewed B=16 L~8192")


def step_cases() -> list[tuple[str, Work]]:
    """The quick table's decode, skewed, wrapped and draft cases, and the full table's mixed step; the
    goals' cases first."""
    quick = [(kind, w) for kind, w in build_cases(quick=True) if kind in STEP_KINDS]
    cases = quick + [(kind, w) for kind, w in build_cases(quick=False) if w.name == MIXED]
    return sorted(cases, key=lambda c: FIRST.index(c[1].name) if c[1].name in FIRST else len(FIRST))


def ours_step(w: Work, inputs: tuple, layers: int, tuning: K.Tuning | None = None) -> Callable[[], list[Tensor]]:
    """One step of ours on w's inputs (``w.ours_inputs``): the plan once, then ``layers`` attends along
    it, layer i on K/V copy i mod (number of copies).  Returns the step; calling it returns the layers'
    outputs (the test checks each against the reference on its own copy; timing ignores them)."""
    q, kvs, q_pos, q_cols, seq_info, cols = inputs
    geo = K.geometry_of(q, kvs[0][0], kvs[0][1], cols, tuning)
    scale = 1 / math.sqrt(w.d)

    def step() -> list[Tensor]:
        plan = K.plan_impl(q_pos, q_cols, seq_info, cols, w.causal, w.window, geo)
        outs = []
        for i in range(layers):
            k, v = kvs[i % len(kvs)]
            outs.append(K.attend_impl(q, k, v, plan, cols, scale, w.causal, w.window, geo))
        return outs
    return step


def peer_step(parts: peers.Parts, layers: int, ctx: object = None, outside: bool = False) -> Callable[[], None]:
    """One step of a peer: its per-step setup (``outside``: ``ctx``, built once beforehand) and
    ``layers`` calls, layer i on its K/V copy i mod ``parts.copies``."""
    def step() -> None:
        c = ctx if outside else parts.setup()
        for i in range(layers):
            parts.layer(c, i % parts.copies)
    return step


def step_bytes(w: Work, layers: int) -> int:
    """Bytes one step moves through attention: each layer reads its K/V and Q and writes O."""
    return layers * w.bytes


def timed(step: Callable[[], object]) -> tuple[float | None, str]:
    """(µs per step, "") or (None, why): a capture that fails says so; nothing is timed eagerly."""
    try:
        return time_fn([step]), ""
    except RuntimeError as e:
        if str(e).startswith(CAPTURE):
            return None, "capture fails: " + str(e)[len(CAPTURE):]
        raise


def _time_peer(name: str, parts: peers.Parts, layers: tuple[int, ...]) -> dict[int, tuple[float | None, str]]:
    """The peer's step at each L, on the same inputs; its setup in the graph, unless it is one of
    OUTSIDE_OK and its capture fails: then built once outside, and the note says so."""
    out: dict[int, tuple[float | None, str]] = {}
    outside_note = None
    for n in layers:
        if outside_note is None:
            out[n] = timed(peer_step(parts, n))
            if out[n][0] is not None or name not in OUTSIDE_OK:
                out[n] = (out[n][0], "; ".join(x for x in (parts.note, out[n][1]) if x))
                continue
            outside_note = f"{OUTSIDE_OK[name]} built outside the graph: {out[n][1]}"
        t, note = timed(peer_step(parts, n, parts.setup(), outside=True))
        out[n] = (t, "; ".join(x for x in (parts.note, note or outside_note) if x))
    return out


def make_row(w: Work, layers: int, ours: tuple[float | None, str], found: dict[str, tuple[float | None, str]]) -> dict:
    """A row of the step table: ours per step and per layer (step / L, plan included), TB/s over the
    step's bytes, each peer's step, the fastest peer and its time / ours (> 1: ours faster)."""
    us, note = ours
    timed_peers = {p: t for p, (t, _) in found.items() if t is not None}
    fastest = min(timed_peers, key=timed_peers.get) if timed_peers else None
    return dict(name=case_name(w), layers=layers, kv=w.kv_read / GB, ours=us, ours_note=note,
                per_layer=us / layers if us else None, bytes=step_bytes(w, layers),
                tbs=step_bytes(w, layers) / us / 1e6 if us else None, peers=found, fastest=fastest,
                ratio=timed_peers[fastest] / us if fastest and us else None)


def _side(what: str, fn: Callable[[], dict], layers: tuple[int, ...]) -> dict[int, tuple[float | None, str]]:
    """fn's times, or its error at every L (the row says it failed; the run goes on); memory freed after."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001
        log(f"  step {what} failed: {type(e).__name__}: {str(e)[:200]}")
        out = {n: (None, f"err {type(e).__name__}") for n in layers}
    torch.cuda.empty_cache()
    return out


def run_case(kind: str, w: Work, layers: tuple[int, ...] = LAYERS, *, flex: bool = False, tuning: K.Tuning | None = None,
             prior: Sequence[dict] = ()) -> list[dict]:
    """The step table's rows of w, one per L: every side's inputs built once and timed at each L, then
    freed.  Wrapped decodes: the peers' work is the uniform one's (their layouts have no rings), their
    times taken from that row in ``prior`` if there."""
    name = case_name(w)
    r = n_rot(w.kv_read)

    def ours_side():
        if w.store_bytes * r > MAX_KV_OURS:
            return {n: (None, "mem") for n in layers}
        inputs = w.ours_inputs(r)
        return {n: timed(ours_step(w, inputs, n, tuning)) for n in layers}

    ours = _side(f"ours on {name}", ours_side, layers)
    found: dict[int, dict[str, tuple[float | None, str]]] = {n: {} for n in layers}
    uni = {(x["name"], x["layers"]): x for x in prior}
    for pname, make in PEERS.items():
        if kind == "wrap":
            for n in layers:
                u = uni.get((name.replace("wrapped", "uniform"), n))
                t, note = u["peers"][pname] if u else (None, "uniform not run")
                found[n][pname] = (t, "= uniform" if t is not None else note)
            continue
        if pname == "flex" and not flex:
            for n in layers:
                found[n][pname] = (None, "not run")
            continue

        def peer_side(make=make, pname=pname):
            parts = make(w)
            if isinstance(parts, str):
                return {n: (None, parts) for n in layers}
            return _time_peer(pname, parts, layers)
        for n, v in _side(f"{pname} on {name}", peer_side, layers).items():
            found[n][pname] = v
    return [make_row(w, n, ours[n], found[n]) for n in layers]


def row_line(r: dict) -> str:
    """The log line of a step row."""
    ps = "  ".join(f"{p}={fmt(t)}{'(' + note + ')' if note else ''}" for p, (t, note) in r["peers"].items())
    ours_note = f" ({r['ours_note']})" if r["ours_note"] else ""
    ratio = f" {r['ratio']:.2f}x" if r["ratio"] else ""
    return (f"step {r['name']} L={r['layers']}: ours {fmt(r['ours'])} us/step{ours_note} = {fmt(r['per_layer'])} us/layer, "
            f"{r['tbs'] or 0:.2f} TB/s | {ps} | fastest peer {r['fastest'] or '—'}{ratio}")
