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




def _chat(engine, turns: int = 3) -> tuple[list[list[int]], list[int]]:
    """A chat of ``turns`` greedy turns through ``engine``: each prompt is the last one, its reply and a new
    message. Each turn's tokens, and the prompt tokens each reused."""
    history, replies, cached = [5, 17, 300, 42, 9, 77, 1, 250, 11, 60] * 3, [], []
    for turn in range(turns):
        events = []
        r = Request(list(history), 8, SamplingParams(temperature=0.0), emit=events.append, ignore_eos=True)
        engine.submit(r)
        run(engine)
        assert events[-1].kind == "done", events[-1]
        assert events[-1].usage["prompt_tokens_details"] == {"cached_tokens": r.cached}
        replies.append(list(r.generated))
        cached.append(r.cached)
        history += r.generated + [100 + turn, 200 + turn, 300 + turn, 400 + turn]
    return replies, cached


def test_a_chat_turn_reuses_the_last_turns_rows_and_gives_the_text_without_reuse(chat_artifact):
    """The engine adopts the rows the last turn left (its prompt and its reply less the reply's last
    token, never fed): usage and /metrics say how many; the text is the text of an engine whose session
    keeps no rows (the server's --no-prefix-cache)."""
    from pipeline.runtime.session import Session

    on = Engine(Session(chat_artifact), Metrics())
    off = Engine(Session(chat_artifact, prefix_cache=False), Metrics())
    replies, cached = _chat(on)
    assert (replies, [0, 0, 0]) == _chat(off)
    assert cached == [0, 30 + 8 - 1, 30 + 8 + 4 + 8 - 1]
    text = on.metrics.render().decode()
    prompts = 30 + 42 + 54
    for name, value in (("pipeline_prefix_cache_reused_tokens_total", sum(cached)),
                        ("pipeline_prefix_cache_queried_tokens_total", prompts),
                        ("pipeline_prefill_tokens_total", prompts - sum(cached)),
                        ("pipeline_prefix_cache_hits_total", 2),
                        ("pipeline_prefix_cache_hit_rate", sum(cached) / prompts)):
        assert f"{name} {float(value)!r}" in text, (name, value, [line for line in text.splitlines() if "prefix" in line])
    assert "pipeline_prefix_cache_queried_tokens_total 0.0" in off.metrics.render().decode()


def _soak(engine, chats: int = 8, turns: int = 3, one_offs: int = 6, every: int = 5) -> dict:
    """``chats`` multi-turn chats at once (each turn submitted when its last one ended, with the whole
    conversation) and one-off requests arriving meanwhile; every tenth turn's client goes away after two
    tokens. Returns each request's tokens by its name; checks that every request ended once."""
    import random

    rng = random.Random(0)
    history = {c: [rng.randrange(100, 500) for _ in range(12 + c)] for c in range(chats)}
    turn = dict.fromkeys(range(chats), 0)
    live, events, out, n = {}, {}, {}, 0  # live: chat -> (name, request, hangs up)
    pending_one_offs = [(f"one{i}", [rng.randrange(100, 500) for _ in range(5 + 7 * i)]) for i in range(one_offs)]
    for step in range(10_000):
        for c in range(chats):
            if c not in live and turn[c] < turns:
                name = f"chat{c}.{turn[c]}"
                events[name] = []
                r = Request(list(history[c]), 8, SamplingParams(temperature=0.0), emit=events[name].append, ignore_eos=True)
                engine.submit(r)
                live[c] = (name, r, n % 10 == 9)
                n += 1
        if pending_one_offs and step % every == 0:
            name, prompt = pending_one_offs.pop(0)
            events[name] = []
            live[name] = (name, Request(prompt, 6, SamplingParams(temperature=0.0), emit=events[name].append,
                                        ignore_eos=True), False)
            engine.submit(live[name][1])
        engine.iterate()
        for key, (name, r, hangs_up) in list(live.items()):
            if hangs_up and len(r.generated) == 2 and not r.cancelled:
                r.cancel()
            if r.finished:
                out[name] = r.generated[:2] if hangs_up else list(r.generated)
                kinds = [e.kind for e in events[name]]
                assert "error" not in kinds and kinds.count("done") == (0 if hangs_up else 1), (name, kinds)
                del live[key]
                if key in history:
                    history[key] += out[name] + [7, 8, 9]
                    turn[key] += 1
        if not live and not pending_one_offs and all(t == turns for t in turn.values()):
            break
    run(engine)  # the last ones' sequences released
    assert not engine.session.seqs and not engine.requests, "no sequence and no request is left behind"
    assert len(out) == chats * turns + one_offs
    return out


@pytest.mark.parametrize("chats, turns, one_offs, every", [(8, 3, 6, 5), (3, 4, 4, 7)], ids=["8-chats", "3-chats"])
def test_a_soak_of_chats_loses_no_request_leaks_no_sequence_and_gives_the_text_without_reuse(chat_artifact, chats, turns,
                                                                                             one_offs, every):
    """Chats at once on four sequences, one-off requests arriving meanwhile, a tenth of the turns hung up
    mid-stream: every request ends once, nothing is left held, and every request's tokens are those of
    an engine whose session keeps no rows. Eight chats on four columns thrash (a waiting request takes
    the column a chat's last turn just left, before its next turn comes: no reuse, and none is wrong);
    three reuse their last turn's rows."""
    from pipeline.runtime.session import Session

    on = Engine(Session(chat_artifact), Metrics(), max_queue=64)
    got = _soak(on, chats, turns, one_offs, every)
    assert len(on.session.prefix_cache.entries) <= on.session.max_seqs  # one per column at most
    hits = [line for line in on.metrics.render().decode().splitlines() if line.startswith("pipeline_prefix_cache_hits_total")]
    if chats < on.session.max_seqs:
        assert float(hits[0].split()[-1]) >= turns, hits
    off = Engine(Session(chat_artifact, prefix_cache=False), Metrics(), max_queue=64)
    assert got == _soak(off, chats, turns, one_offs, every)
