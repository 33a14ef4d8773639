"""Aggregate decode speed of a built artifact through its session: every sequence it serves
prefilled with ``context`` tokens, then ``steps`` decode steps of all of them at once."""

import statistics
import time
from pathlib import Path


def decode_rate(version: Path, steps: int = 16, context: int = 32) -> dict:
    """Median session step time of a decode of all ``max_seqs`` sequences, and tokens/s (sequences / step).
    ``context`` and ``steps`` shrink to what the store holds (a cell pool is shared by the sequences)."""
    from pipeline.runtime.session import Session

    session = Session(version)
    seqs = session.max_seqs
    if session.max_length is not None:
        room = session.max_length // (seqs if session.layout == "cell" else 1)
        steps = max(1, min(steps, room // 2))
        context = max(1, min(context, room - steps))
    for i in range(seqs):
        session.add(i)
        for start in range(0, context, session.max_step_tokens):
            session.step({i: [7] * min(session.max_step_tokens, context - start)})
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        session.step({i: [11] for i in range(seqs)})
        times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"sequences": seqs, "context": context, "steps": steps, "step_ms": step * 1e3, "tokens_per_s": seqs / step}
