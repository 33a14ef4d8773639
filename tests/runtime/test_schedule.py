"""The schedule (``runtime/schedule.py``) on plain slots, no artifact: every decode fed each step, the
chunk widths, admissions and releases, no prompt starved, arrival order kept."""

import itertools

import pytest

from pipeline.runtime.schedule import Budget, Plan, Slot, State, plan


def slot(sid, prompt_len, cells=0, state=State.WAITING, fed=0, next_token=None):
    return Slot(sid, list(range(100, 100 + prompt_len)), cells=cells, state=state, fed=fed, next_token=next_token)


def decoding(sid, cells=0):
    return slot(sid, 3, cells, State.DECODING, fed=3, next_token=7)


def accepted(feeds: dict, budget: Budget) -> bool:
    """The session's rule for a step's width: up to max_step_tokens; one token per sequence, up to max_seqs."""
    widths = [len(toks) for toks in feeds.values()]
    return sum(widths) <= (budget.max_seqs if all(w == 1 for w in widths) else budget.max_step_tokens)


def drive(arrivals: dict[int, list[tuple[Slot, int]]], budget: Budget, limit: int = 2000):
    """Run plans as a caller does: slots arrive at their step (``arrivals``: step -> (slot, tokens it
    generates)), each step is executed (a round gives 2 tokens), a slot finishes after its tokens.
    Yields (the states before the step, the plan) of every step."""
    slots, left = [], {}
    for n in range(limit):
        for s, tokens in arrivals.get(n, []):
            slots.append(s)
            left[s.id] = tokens
        if not slots and n > max(arrivals):
            return
        before = {s.id: s.state for s in slots}
        step = plan(slots, budget)
        yield before, step
        for s in step.released:
            slots.remove(s)
        for s in step.admitted:
            s.admit()
        by_id = {s.id: s for s in slots}
        made = {sid: 1 for sid, toks in step.feeds.items() if by_id[sid].took(len(toks))}
        made |= {sid: 2 for sid in step.speculate}
        for sid, count in made.items():
            by_id[sid].next_token = 7
            left[sid] -= count
            if left[sid] <= 0:
                by_id[sid].finish()
    raise AssertionError("the slots did not finish")


def layouts():
    """(budget, arrivals) over widths, sequence counts, chunk caps, speculation and cell pools."""
    for mst, seqs, chunk, spec in itertools.product((4, 16), (2, 4, 8), (None, 3), (False, True)):
        arrivals = {0: [(slot(f"a{i}", 5 + 9 * i, cells=40), 6 + i) for i in range(seqs)],
                    3: [(slot("late", 37, cells=60), 4)], 5: [(slot("later", 2, cells=10), 30)]}
        yield Budget(mst, seqs, chunk, spec), arrivals
        yield Budget(mst, seqs, chunk, spec, cells=150), arrivals


def test_every_decode_is_fed_each_step_and_every_step_is_one_the_session_takes():
    for budget, arrivals in layouts():
        fresh = {n: [(slot(s.id, len(s.prompt), s.cells), k) for s, k in items] for n, items in arrivals.items()}
        for before, step in drive(fresh, budget):
            for sid, state in before.items():
                if state is State.DECODING:
                    if budget.speculative:
                        assert step.speculate[sid] == 7 and sid not in step.feeds
                    else:
                        assert step.feeds[sid] == [7]
            assert accepted(step.feeds, budget), (budget, step.feeds)


def test_chunks_stay_within_the_width_and_the_chunk_cap_while_others_decode():
    budget = Budget(max_step_tokens=16, max_seqs=4, prefill_chunk=5)
    alone = plan([slot("a", 40)], budget)
    assert alone.feeds == {"a": list(range(100, 116))}  # alone, a prompt takes the whole width
    slots = [decoding("d1"), decoding("d2"), slot("p", 40, state=State.PREFILLING, fed=10), slot("q", 40)]
    step = plan(slots, budget)
    assert step.feeds["d1"] == step.feeds["d2"] == [7]
    assert step.feeds["p"] == list(range(110, 115)) and "q" not in step.feeds  # capped at 5, the older first
    uncapped = plan(slots, Budget(16, 4))
    assert len(uncapped.feeds["p"]) == 14 and "q" not in uncapped.feeds  # the 14 the decodes leave
    short = [decoding("d1"), slot("p", 40, state=State.PREFILLING, fed=36), slot("q", 40)]
    step = plan(short, Budget(16, 4))
    assert len(step.feeds["p"]) == 4 and len(step.feeds["q"]) == 11  # p's last 4, q the rest of the width
    spec = plan(slots, Budget(16, 4, prefill_chunk=5, speculative=True))
    assert spec.speculate == {"d1": 7, "d2": 7} and spec.feeds == {"p": list(range(110, 115))}  # they decode: capped
    for before, step in drive({0: [(slot("x", 50), 20), (slot("y", 3), 40), (slot("z", 60), 3)]}, Budget(8, 3, 3)):
        prompts = [len(t) for sid, t in step.feeds.items() if before.get(sid) is not State.DECODING]
        assert sum(prompts) + sum(1 for s in before.values() if s is State.DECODING) <= 8
        if any(s is State.DECODING for s in before.values()):
            assert sum(prompts) <= 3


def test_admission_stops_at_max_seqs_and_at_the_pool_in_arrival_order():
    slots = [decoding("d"), slot("a", 4, cells=50), slot("b", 4, cells=50), slot("c", 4, cells=5)]
    assert [s.id for s in plan(slots, Budget(16, 3)).admitted] == ["a", "b"]  # a sequence each, 3 at most
    # the pool: d holds 60 of 120; a fits, b does not, and c (small) does not overtake b
    slots[0].cells = 60
    assert [s.id for s in plan(slots, Budget(16, 8, cells=120)).admitted] == ["a"]
    with pytest.raises(ValueError, match="reserves 500 cells, more than the pool's 120"):
        plan([slot("huge", 4, cells=500)], Budget(16, 2, cells=120))


def test_a_done_slot_is_released_and_its_sequence_and_cells_serve_the_same_plan():
    done = decoding("d", cells=100)
    done.finish()
    slots = [done, decoding("e", cells=10), slot("w", 4, cells=100)]
    step = plan(slots, Budget(16, 2, cells=120))
    assert step.released == [done] and step.admitted == [slots[2]]
    assert "d" not in step.feeds and step.feeds["w"] == [100, 101, 102, 103]  # the admitted slot prefills now
    assert plan([decoding("e", cells=10), slot("w", 4, cells=100)], Budget(16, 1)).admitted == []  # no sequence free


def test_no_prompt_starves_when_more_sequences_decode_than_a_step_is_wide():
    """max_seqs=8 > max_step_tokens=4: seven streams decoding fill the width (a step of one token per
    sequence may be 8 wide); a prompt arriving must still start, and the streams keep their token."""
    budget = Budget(max_step_tokens=4, max_seqs=8)
    arrivals = {0: [(decoding(f"d{i}"), 10_000) for i in range(7)], 2: [(slot("new", 6), 1)]}
    states = []
    for n, (before, step) in enumerate(itertools.islice(drive(arrivals, budget), 12)):
        states.append(before.get("new"))
        if before.get("new") is State.PREFILLING:
            assert len(step.feeds.get("new", [])) == 1, f"step {n}: the prompt starves"
            assert accepted(step.feeds, budget)  # a token a step, the streams too
            assert all(step.feeds[f"d{i}"] == [7] for i in range(7))
    assert states[2:9] == [State.WAITING] + [State.PREFILLING] * 5 + [State.DONE]  # its 6 tokens in 6 steps


def test_fifo_the_oldest_prompt_is_admitted_and_prefilled_first():
    arrivals = {0: [(slot(f"p{i}", 12), 2) for i in range(5)]}
    admitted, first_fed = [], {}
    for n, (_, step) in enumerate(drive(arrivals, Budget(max_step_tokens=8, max_seqs=2))):
        admitted += [s.id for s in step.admitted]
        for sid in step.feeds:
            first_fed.setdefault(sid, n)
        older = [sid for sid in step.feeds if len(step.feeds[sid]) > 1]
        assert older == sorted(older)  # chunks in arrival order
    assert admitted == [f"p{i}" for i in range(5)]
    assert list(first_fed) == [f"p{i}" for i in range(5)]
    assert all(first_fed[f"p{i}"] <= first_fed[f"p{i + 1}"] for i in range(4))


def test_bad_budgets_slots_and_states_are_refused_by_name():
    with pytest.raises(ValueError, match="max_step_tokens=0 must be an integer >= 1"):
        Budget(0, 4)
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        Budget(4, 4, prefill_chunk=0)
    with pytest.raises(ValueError, match="empty prompt"):
        Slot("e", [])
    with pytest.raises(ValueError, match="decoding with no next_token"):
        plan([slot("d", 3, state=State.DECODING, fed=3)], Budget(4, 4))
    with pytest.raises(ValueError, match="is decoding, not waiting"):
        decoding("d").admit()
    assert plan([], Budget(4, 4)) == Plan()


def test_a_slot_starts_past_the_prefix_the_session_reused_and_always_feeds_its_last_prompt_token():
    """With the prefix cache, an admitted slot may adopt all of its prompt but the last token; told how
    many the session reused, it starts there, and its chunk of this step moves past them."""
    a, b = slot("a", 40), slot("b", 5)
    step = plan([a, b], Budget(16, 4, prefix_cache=True))
    assert step.prefixes == {"a": a.prompt[:-1], "b": b.prompt[:-1]}
    assert step.feeds == {"a": a.prompt[:16]}  # b: no width left this step
    step.admit(a, 30)
    step.admit(b, 4)
    assert step.feeds == {"a": a.prompt[30:40]} and (a.fed, b.fed) == (30, 4)
    assert a.took(10) and a.state is State.DECODING  # the prompt's end: its logits choose a's first token
    a.next_token = 7
    assert plan([a, b], Budget(16, 4, prefix_cache=True)).feeds == {"a": [7], "b": b.prompt[4:]}


def test_a_reused_count_beyond_the_plans_prefix_is_refused():
    a, b = slot("a", 6), slot("b", 6)
    step = plan([a], Budget(16, 4, prefix_cache=True))
    with pytest.raises(ValueError, match=r"reused=6 must be an integer in \[0, 5\]"):
        step.admit(a, 6)
    with pytest.raises(ValueError, match="not one this plan admits"):
        step.admit(b, 0)
    off = plan([b], Budget(16, 4))  # prefix cache off: nothing to adopt
    assert off.prefixes == {}
    with pytest.raises(ValueError, match=r"reused=1 must be an integer in \[0, 0\]"):
        off.admit(b, 1)
    assert a.state is State.WAITING and b.state is State.WAITING  # refused: nothing changed
    with pytest.raises(ValueError, match=r"reused=6 must be an integer in \[0, 5\]"):
        a.admit(6)
