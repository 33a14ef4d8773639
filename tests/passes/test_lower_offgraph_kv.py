"""LowerOffGraphKVPass: node counts, step buffers as inputs, numbers against the oracle,
and a pinned summary of each layout's lowered graph."""

import collections
import json
import os
from pathlib import Path

import pytest
import torch

from conftest import compose_config
from pipeline.build.plan import plan_of
from pipeline.build.roles import TARGET, TARGET_STEP
from pipeline.kv.op import ReferenceCache, reference_cache
from pipeline.kv.quantize import rounding
from pipeline.passes.lower_offgraph_kv import count_neutral, lower_offgraph_kv
from pipeline.stages import export

GOLDEN = Path(__file__).parent / "golden"
LAYOUTS = {
    "sequence": (),
    "batched-sequence": ("kv.max_seqs=4",),
    "cell": ("kv=cell", "kv.max_seqs=3"),
}
# an 8-bit cache (kv.dtype=int8): both layouts' numbers against an oracle whose caches round the same way
QUANTIZED = {
    "batched-sequence-int8": ("kv.max_seqs=4", "kv.dtype=int8"),
    "cell-int8": ("kv=cell", "kv.max_seqs=3", "kv.dtype=int8"),
}


@pytest.fixture(scope="module")
def lowered():
    out = {}
    for name, overrides in (LAYOUTS | QUANTIZED).items():
        cfg = compose_config(*overrides)
        plan = plan_of(cfg)
        exported = export.run(plan, {}, None)
        model = exported["models"][TARGET]
        ep = exported["exported"][TARGET_STEP]
        target = plan.target
        spec = target.role.example_inputs(target.methods[1], target, plan.parts, torch.float32, None)
        out[name] = (model, target.layout, ep, lower_offgraph_kv(ep, target.layout, spec))
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_neutral_node_lowered(lowered, name):
    _, layout, before, after = lowered[name]
    assert count_neutral(before) == 4
    assert count_neutral(after) == 0
    user_inputs = list(after.graph_signature.user_inputs)
    assert user_inputs[:3] == ["embeddings", "positions", "logit_rows"]
    assert user_inputs[3:] == [b.name for b in layout.step_buffers()], "every step buffer is a method input"
    stores = {n: tuple(t.shape) for n, t in after.state_dict.items() if n.startswith("kv_store.")}
    assert len(stores) == 2 * len(layout.layers)
    planned = sum(t.numel() * t.element_size() for n, t in after.state_dict.items() if n.startswith("kv_store."))
    assert planned == sum(layout.kv_bytes_per_layer())


def test_pass_fails_loudly_without_neutral_op(lowered):
    from pipeline.passes.lower_offgraph_kv import LoweringError

    _, layout, _, after = lowered["sequence"]
    with pytest.raises(LoweringError, match="no kvcache::update_and_attend"):
        lower_offgraph_kv(after, layout, None)


def summary(ep) -> dict:
    ops = collections.Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")
    return {
        "ops": dict(sorted(ops.items())),
        "buffers": {n: list(t.shape) for n, t in sorted(ep.state_dict.items()) if n.startswith("kv_store.")},
        "inputs": list(ep.graph_signature.user_inputs),
    }


@pytest.mark.parametrize("name", LAYOUTS)
def test_lowered_graph_summary_is_pinned(lowered, name):
    """Adding or changing one layout must not change what another one lowers to."""
    got = summary(lowered[name][3])
    path = GOLDEN / f"lowered_{name}.json"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(path.read_text()), f"{name} lowering changed; if intended, rerun with UPDATE_GOLDEN=1"


def _oracle_logits(model, tokens, start, cache):
    with reference_cache(cache), torch.no_grad():
        return model.logits(model.hidden(model.embed(torch.tensor(tokens)), torch.arange(start, start + len(tokens)))[-1:])[0]


@pytest.mark.parametrize("name", [*LAYOUTS, *QUANTIZED])
def test_lowered_numbers_equal_oracle(lowered, name):
    """Two sequences prefilled in one step, then decoded together, against per-sequence eager caches
    (an 8-bit cache's: rounding what they keep as the store does)."""
    errors = _errors_against_oracle(*lowered[name], rounding(lowered[name][1].dtype))
    assert max(errors) <= 1e-4, errors


def test_int8_store_is_not_the_float_cache(lowered):
    """The 8-bit store rounds: against an oracle with float caches it is visibly off, so the test above
    tells the two apart (its oracle's rounding is what makes it pass)."""
    model, layout, ep, after = lowered["batched-sequence-int8"]
    stores = {n: b for n, b in after.named_buffers() if n.startswith("kv_store.")}
    assert {b.dtype for n, b in stores.items() if "scale" not in n} == {torch.int8}
    assert [tuple(stores[f"kv_store.{kv}_scale_{i}"].shape) for i in range(len(layout.layers)) for kv in "kv"] == [
        layout.scale_shape(layer) for layer in layout.layers for _ in "kv"]
    assert min(_errors_against_oracle(model, layout, ep, after, None)) > 1e-4  # every step over the bound above


def _errors_against_oracle(model, layout, _ep, after, kv_rounding) -> list[float]:
    module = after.module()
    module = after.module()
    gen = torch.Generator().manual_seed(1)
    prompts = {0: torch.randint(0, 512, (9,), generator=gen).tolist(), 1: torch.randint(0, 512, (6,), generator=gen).tolist()}
    caches = {s: ReferenceCache(model.args.layer_kv(), layout.causal, rounding=kv_rounding) for s in prompts}
    errors = []
    lengths = {0: 0, 1: 0}
    cells = iter(range(layout.capacity))
    cell_pos = torch.zeros(layout.capacity, dtype=torch.int64)
    cell_owners = torch.zeros(layout.capacity, dtype=torch.int64)
    slots = {0: 0, 1: 1} if layout.layout != "sequence" else None
    seqs = [0, 1] if slots else [0]
    feeds_per_step = [{s: prompts[s] for s in seqs}, {s: [7] for s in seqs}, {s: [11] for s in seqs}]
    for feeds in feeds_per_step:
        tokens, positions, cols, ids, bits = [], [], [], [], []
        for s, toks in feeds.items():
            for t in toks:
                tokens.append(t)
                positions.append(lengths[s])
                cols.append(s)
                if layout.layout == "cell":
                    c = next(cells)
                    cell_pos[c], cell_owners[c] = lengths[s], 1 << s
                    ids.append(c)
                    bits.append(1 << s)
                lengths[s] += 1
        step = {"seq_cols": torch.tensor(cols), "cell_ids": torch.tensor(ids), "q_seq_bits": torch.tensor(bits),
                "cell_pos": cell_pos.clone(), "cell_owners": cell_owners.clone()}
        step |= _gathered(layout, feeds, lengths, cell_pos, cell_owners)
        last = torch.tensor(list(itertools_accumulate([len(t) for t in feeds.values()])))
        got = module(model.embed(torch.tensor(tokens)), torch.tensor(positions), last,
                     *[step[b.name] for b in layout.step_buffers()])
        for i, (s, toks) in enumerate(feeds.items()):
            want = _oracle_logits(model, toks, lengths[s] - len(toks), caches[s])
            errors.append(float((got[i] - want).abs().max() / (want.max() - want.min())))
    return errors


def _gathered(layout, feeds: dict, lengths: dict, cell_pos, cell_owners) -> dict:
    """The gathered attention's step buffers, written out by hand: the first sequence's tokens are the
    block when it feeds several, every other token attends alone over its sequence's keys."""
    def keys(s, kind):  # (slots, positions) sequence s holds after the step, in position order
        if layout.layout == "cell":
            mine = ((cell_owners & (1 << s)) != 0).nonzero().flatten().tolist()
            mine.sort(key=lambda c: int(cell_pos[c]))
            return mine, [int(cell_pos[c]) for c in mine]
        rows = layout.rows_of(kind)
        pos = list(range(max(0, lengths[s] - rows), lengths[s]))
        return [(p % rows) * layout.columns + (s if layout.columns > 1 else 0) for p in pos], pos

    seqs = list(feeds)
    block_seq = seqs[0] if len(feeds[seqs[0]]) > 1 else None
    alone = [(s, i) for s in seqs if s != block_seq for i in range(len(feeds[s]))]
    starts, total = {}, 0
    for s in seqs:  # each sequence's first token in the step
        starts[s], total = total, total + len(feeds[s])
    one_q = [starts[s] + i for s, i in alone]
    block_q = [starts[block_seq] + i for i in range(len(feeds[block_seq]))] if block_seq is not None else []
    out_rows = [0] * total
    for row, tok in enumerate(one_q):
        out_rows[tok] = row
    for j, tok in enumerate(block_q):
        out_rows[tok] = max(len(one_q), 1) + j
    step = {"block_q": torch.tensor(block_q or [0]), "out_rows": torch.tensor(out_rows)}
    for kind in (["cells"] if layout.layout == "cell" else layout.kinds):
        lists = [keys(s, kind) for s, _ in alone] or [([0], [-1])]
        width = max(len(k) for k, _ in lists)
        tokens = one_q or [0]  # each row: slots, positions, the token
        step[f"one_{kind}"] = torch.tensor([[k + [0] * (width - len(k)), p + [-1] * (width - len(p)), [t] * width]
                                            for t, (k, p) in zip(tokens, lists, strict=True)])
        step[f"block_{kind}"] = torch.tensor(keys(block_seq, kind) if block_seq is not None else ([0], [-1]))
    return step


def itertools_accumulate(counts):
    total = 0
    for n in counts:
        total += n
        yield total - 1
