"""Aggregate decode speed of a built artifact through its session: every sequence it serves prefilled
with ``context`` tokens on the server's schedule (``runtime/schedule.py``), then ``steps`` decode steps
of all of them at once."""

import statistics
import time
from pathlib import Path

from pipeline.runtime import schedule
from pipeline.runtime.schedule import Budget, Slot, State


def decode_rate(version: Path, steps: int = 16, context: int = 32) -> dict:
    """Median session step time of a decode of all ``max_seqs`` sequences, and tokens/s (sequences / step).
    ``context`` and ``steps`` shrink to what the store holds (a cell pool is shared by the sequences)."""
    from pipeline.runtime.session import Session

    session = Session(version)
    seqs = session.max_seqs
    budget = Budget(session.max_step_tokens, seqs)
    if session.max_length is not None:
        cell = session.layout == "cell"
        room = session.max_length // (seqs if cell else 1)
        steps = max(1, min(steps, room // 2))
        context = max(1, min(context, room - steps))
        # those whose prompt ends first decode while the others prefill: the schedule, run dry, says how long
        # each sequence gets, and the prompts shrink until the store holds them
        while context > 1 and (sum if cell else max)(_drive(None, seqs, context, steps, budget)[0]) > session.max_length:
            context -= 1
    times = _drive(session, seqs, context, steps, budget)[1]
    step = statistics.median(times)
    return {"sequences": seqs, "context": context, "steps": steps, "step_ms": step * 1e3, "tokens_per_s": seqs / step}


def _drive(session, seqs: int, context: int, steps: int, budget: Budget) -> tuple[list[int], list[float]]:
    """The schedule over ``seqs`` prompts of ``context`` tokens until ``steps`` steps found all of them
    decoding: each sequence's length then, and those steps' times. ``session`` None: a dry run (the
    schedule needs no program to say what each step feeds)."""
    slots = [Slot(i, [7] * context) for i in range(seqs)]
    lengths, times = [0] * seqs, []
    while len(times) < steps:
        plan = schedule.plan(slots, budget)
        decoding = all(slot.state is State.DECODING for slot in slots)
        for slot in plan.admitted:
            if session is not None:
                session.add(slot.id)
            slot.admit()
        start = time.perf_counter()
        if session is not None:
            session.step(plan.feeds)
        if decoding:
            times.append(time.perf_counter() - start)
        for i, toks in plan.feeds.items():
            lengths[i] += len(toks)
            if slots[i].took(len(toks)):
                slots[i].next_token = 11
    return lengths, times
