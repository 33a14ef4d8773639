"""The engine over a stand-in session (no artifact): its steps are the schedule's (a prompt arriving
while more streams decode than a step is wide still starts, and every stream keeps its token), and a
request whose sequence or image the session refuses is told what was wrong, the others served."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import SessionError
from pipeline.runtime.sampling import SamplingParams
from pipeline.serve.engine import Engine
from pipeline.serve.metrics import Metrics
from pipeline.serve.request import Request


class StandIn:
    """What the engine asks of a session: sequences, images and steps held to the session's width rule."""

    def __init__(self, max_seqs: int, max_step_tokens: int, vision: dict | None = None, image_error=None):
        self.max_seqs, self.max_step_tokens, self.max_length = max_seqs, max_step_tokens, 1000
        self.speculation, self.pool, self.vision, self.image_error = None, object(), vision, image_error
        self.prefix_cache = None  # it keeps no released rows: the plans offer no prefixes
        self.tokenizer = SimpleNamespace(eos_token_id=None)
        self.seqs: dict = {}
        self.steps: list[dict] = []

    def add(self, seq_id, prefix=(), images=()) -> int:
        if seq_id in self.seqs or len(self.seqs) >= self.max_seqs:
            raise SessionError(f"cannot add sequence {seq_id!r}")
        assert not prefix, "a plan without the prefix cache offers no prefix"
        self.seqs[seq_id] = 0
        return 0

    def release(self, seq_id) -> None:
        del self.seqs[seq_id]

    def add_image(self, seq_id, image) -> None:
        raise self.image_error

    def step(self, feeds: dict) -> dict:
        widths = [len(toks) for toks in feeds.values()]
        bound = self.max_seqs if all(w == 1 for w in widths) else self.max_step_tokens
        assert sum(widths) <= bound, f"a step of {widths} tokens, past {bound}"
        self.steps.append({seq_id: len(toks) for seq_id, toks in feeds.items()})
        for seq_id, toks in feeds.items():
            self.seqs[seq_id] += len(toks)
        return {seq_id: torch.zeros(4) for seq_id in feeds}


class Counting(Engine):
    """The engine, its tokens counted instead of detokenised (the steps are what is tested here)."""

    def _give(self, request, tokens):
        request.generated += [token for token, _ in tokens]
        if len(request.generated) >= request.max_tokens:
            self._finish(request, "length")


def test_a_prompt_starts_while_more_streams_decode_than_a_step_is_wide():
    """max_seqs=8 > max_step_tokens=4: the seven streams fill the width; the prompt still moves a token
    a step, in steps of one token per sequence, and every stream is fed every step."""
    session = StandIn(max_seqs=8, max_step_tokens=4)
    engine = Counting(session, Metrics())
    streams = [Request([5], 1000, emit=lambda event: None) for _ in range(7)]
    for r in streams:
        engine.submit(r)
    for _ in range(4):  # 4 prompts in the first step, then one a step: all seven decode
        engine.iterate()
    assert session.steps[-1] == {r.id: 1 for r in streams}
    events = []
    prompt = Request([1, 2, 3, 4, 5, 6], 1, emit=events.append)
    engine.submit(prompt)
    for _ in range(6):
        engine.iterate()
        assert all(session.steps[-1][r.id] == 1 for r in streams)
    assert [e.kind for e in events] == ["done"] and len(prompt.generated) == 1


@pytest.mark.parametrize(("vision", "error", "status", "code"), [
    ({"n_image_tokens": 4}, SessionError("the image is 900x900 pixels, larger than the artifact's exported image size"),
     400, "invalid_image"),
    ({"n_image_tokens": 4}, SessionError("sequence 3: the image's 4 tokens would take it to 70 tokens, past the context of 64"),
     400, "context_length_exceeded"),
    (None, SessionError("the artifact has no vision encoder: build with vision=smolvlm_tiny"), 400, "invalid_request"),
])
def test_a_refused_image_is_reported_as_what_it_is_and_the_others_are_served(vision, error, status, code):
    session = StandIn(max_seqs=2, max_step_tokens=8, vision=vision, image_error=error)
    engine = Counting(session, Metrics())
    bad, good = [], []
    engine.submit(Request([1, 2], 3, images=["an image"], emit=bad.append))
    engine.submit(Request([3, 4], 3, emit=good.append))
    for _ in range(5):
        engine.iterate()
    assert (bad[-1].kind, bad[-1].status, bad[-1].code) == ("error", status, code) and str(error) == bad[-1].message
    assert [e.kind for e in good] == ["done"] and not session.seqs and not engine.slots


def test_an_encoder_failure_is_the_servers_and_a_sequence_refused_is_the_requests():
    failed = SessionError("the program failed encoding the image of sequence 0")
    failed.__cause__ = RuntimeError("planted")
    session = StandIn(max_seqs=2, max_step_tokens=8, vision={"n_image_tokens": 4}, image_error=failed)
    engine = Counting(session, Metrics())
    events = []
    engine.submit(Request([1], 3, images=["an image"], emit=events.append))
    engine.iterate()
    assert (events[-1].status, events[-1].code) == (500, "image_encoding_failed")
    session.add("7")  # the session already holds a sequence of this id
    engine.submit(Request([1], 3, emit=events.append, id="7"))
    engine.iterate()
    assert (events[-1].status, events[-1].code) == (400, "invalid_request")
    assert list(session.seqs) == ["7"] and not engine.slots  # the session's own sequence 7 is left alone


class Letters:
    """A tokenizer of one letter a token (id 0 is EOS, decoded as nothing)."""

    eos_token_id = 0
    all_special_ids = [0]

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i == 0 and skip_special_tokens else "</s>" if i == 0 else chr(96 + i) for i in ids)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_ignore_eos_runs_to_max_tokens(ignore_eos):
    """A model that says EOS at once: a request ends there ("stop"), or with ``ignore_eos`` (vLLM's and
    llama.cpp's extension, which the benchmark asks of both servers) runs to its max_tokens ("length")."""
    session = StandIn(max_seqs=2, max_step_tokens=4)
    session.tokenizer = Letters()
    engine = Engine(session, Metrics())
    events = []
    request = Request([3, 4], 5, SamplingParams(temperature=0), emit=events.append, ignore_eos=ignore_eos)  # greedy
    engine.submit(request)
    for _ in range(8):
        engine.iterate()
    done = [e for e in events if e.kind == "done"]
    assert len(done) == 1
    assert (done[0].finish_reason, len(request.generated)) == (("length", 5) if ignore_eos else ("stop", 1))
