# ruff: noqa: F811  (the fixtures imported from server_fixtures are parameters of the tests)
"""The engine in-process over a real Session: the chunked-prefill policy (every step feeds every decoding
sequence, a long prompt takes what is left of the width), a failing step failing only its requests, the
queue limit before any work, and greedy text equal to the Session's own."""

import pytest

from pipeline.runtime.sampling import SamplingParams
from pipeline.serve.engine import Engine, Overloaded
from pipeline.serve.metrics import Metrics
from pipeline.serve.request import Request
from server_fixtures import chat_artifact  # noqa: F401


@pytest.fixture
def engine(chat_artifact):
    from pipeline.runtime.session import Session

    return Engine(Session(chat_artifact), Metrics(), max_queue=2)


def request(ids, max_tokens, events, temperature=0.0, seed=None):
    return Request(list(ids), max_tokens, SamplingParams(temperature=temperature, seed=seed), emit=events.append)


def run(engine, limit=5000):
    for _ in range(limit):
        if not (engine.running or engine.waiting):
            return
        engine.iterate()
    raise AssertionError("the engine did not finish")


def test_every_step_feeds_every_decoding_sequence_and_a_long_prompt_takes_the_rest(engine):
    session = engine.session
    steps = []
    real_step = session.step

    def spy(feeds):
        steps.append({rid: len(toks) for rid, toks in feeds.items()})
        return real_step(feeds)

    session.step = spy
    events = []
    short = [request([100 + i, 200, 300], 40, events) for i in range(3)]
    for r in short:
        engine.submit(r)
    for _ in range(3):
        engine.iterate()  # the three are decoding now
    long = request(range(1000, 2000), 2, events)
    engine.submit(long)
    run(engine)
    width = session.max_step_tokens
    prefill_steps = [s for s in steps if long.id in s and s[long.id] > 1]
    assert len(prefill_steps) >= 1000 // width
    for s in prefill_steps:
        assert all(s[r.id] == 1 for r in short if r.id in s)  # each running stream keeps its token per step
        assert sum(s.values()) <= width
    for s in prefill_steps[:-1]:  # the prompt takes exactly the width the decodes leave (its last chunk may be less)
        assert s[long.id] == width - (len(s) - 1)
    assert any(len([r for r in short if r.id in s]) == 3 for s in prefill_steps)
    assert [e.kind for e in events].count("done") == 4
    assert len(long.generated) == 2 and all(len(r.generated) == 40 or r.generated[-1] in engine.eos for r in short)
    assert not session.seqs


def test_greedy_text_is_the_sessions_and_a_failing_step_fails_only_its_requests(engine):
    from pipeline.build.roles import TARGET_STEP

    session = engine.session
    ids = session.tokenizer("The capital of France is").input_ids
    alone = []
    first = request(ids, 16, alone)
    engine.submit(first)
    run(engine)
    method = session.method(TARGET_STEP)
    real = method.execute
    calls = {"n": 0}

    def flaky(args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted failure")
        return real(args)

    session._methods[TARGET_STEP] = type("M", (), {"execute": staticmethod(flaky)})()
    events_a, events_b = [], []
    a, b = request(ids, 16, events_a), request([5, 6, 7], 16, events_b)
    engine.submit(a)
    engine.submit(b)
    run(engine)
    assert events_a[-1].kind == "error" and "planted failure" in events_a[-1].message
    assert events_b[-1].kind == "error"  # both were in the failing step
    assert not session.seqs and not engine.running
    again = []
    c = request(ids, 16, again)
    engine.submit(c)
    run(engine)
    assert again[-1].kind == "done" and c.generated == first.generated  # the session is intact
    assert engine.metrics.requests.labels(outcome="error")._value.get() == 2


def test_the_queue_refuses_beyond_max_queue_before_any_work(engine):
    events = []
    for i in range(engine.session.max_seqs + 2):  # four take sequences at the next iteration, two wait
        engine.submit(request([10 + i], 4, events))
    with pytest.raises(Overloaded, match="max-queue"):
        engine.submit(request([1], 4, events))
    run(engine)
    assert [e.kind for e in events].count("done") == engine.session.max_seqs + 2


def test_a_sampled_request_depends_on_its_seed_only(engine):
    ids = [11, 12, 13]
    alone = request(ids, 20, [], temperature=1.0, seed=9)
    engine.submit(alone)
    run(engine)
    crowd = [request([40 + i, 41], 20, [], temperature=1.0, seed=i) for i in range(3)]
    again = request(ids, 20, [], temperature=1.0, seed=9)
    for r in [*crowd, again]:
        engine.submit(r)
    run(engine)
    assert again.generated == alone.generated


