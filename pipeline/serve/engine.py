"""The engine: one thread owns the ``Session`` and runs continuous batching over it.

Each request has a ``schedule.Slot`` (waiting, prefilling, decoding, done), and every step is what
``schedule.plan`` says (the one schedule validate's episode, ``Session.generate`` and the throughput
measurement run too). Each iteration of its loop:

1. drops what ended outside a step: requests whose client went away (cancelled) or whose
   ``--request-timeout`` passed, waiting or running;
2. asks the schedule for the step's plan, and releases the sequences of the requests that ended;
3. admits waiting requests, oldest first, while the artifact has a free sequence (and, in a cell
   layout, the pool has cells for the request's prompt, its ``max_tokens`` and a draft block); with
   the session's prefix cache, a request's sequence starts from a released sequence's rows where its
   prompt begins alike (the plan's prefix; the session decides what its rows still hold), and only the
   rest of its prompt is prefilled (``usage.prompt_tokens_details.cached_tokens``);
4. runs one target step that feeds every live sequence: one token of each decoding sequence and,
   in what is left of the step's ``max_step_tokens`` (at most ``--prefill-chunk`` while others
   decode), the next chunk of each prefilling prompt, oldest first (so a long prompt arriving never
   stops the streams already running: they keep their token per step, and the prompt takes the rest
   of the width; the oldest prompt takes a token even when the streams fill the width). With a draft,
   decoding sequences take a speculative round instead, in a second program call of the same iteration;
5. chooses each sequence's next token with its own policy (greedy or its seeded sampler), checks
   end of sequence, stop strings and ``max_tokens``, sends the text, and marks a finished request
   done (the next iteration's plan releases its sequence).

A ``SessionError`` from a step fails the requests of that step only (the step is transactional:
the session is as it was), and the loop goes on. The HTTP side talks to the engine through
``submit`` (thread-safe, refuses beyond ``max_queue`` waiting requests) and each request's
``emit`` callback, which the engine calls from its thread.
"""

import logging
import threading
import time

from pipeline.errors import SessionError
from pipeline.runtime import schedule
from pipeline.runtime.sampling import policy, top_logprobs
from pipeline.runtime.schedule import Budget, Slot, State
from pipeline.serve.request import Event, Request, Token

log = logging.getLogger("pipeline.serve")


class Overloaded(Exception):
    """The queue is full: the request was refused before any work."""


class Engine:
    """Continuous batching over ``session`` in a thread of its own (module docstring)."""

    def __init__(self, session, metrics, max_queue: int = 64, eos: set[int] | None = None, prefill_chunk: int | None = None):
        self.session = session
        self.metrics = metrics
        self.max_queue = max_queue
        eos_id = session.tokenizer.eos_token_id
        self.eos = eos if eos is not None else ({eos_id} if eos_id is not None else set())
        self.block = session.speculation.block_size if session.speculation else 0
        cells = getattr(session.pool, "n_cells", None)  # a cell layout's shared pool: admission reserves cells
        # the most tokens (prompt + max_tokens) one request may take: the sequence's context, or the pool
        # less a draft block; None: unbounded (a model of ring layers only)
        self.context_limit = session.max_length if cells is None else cells - self.block
        # prefill_chunk: prompt tokens a step takes while other sequences decode (None: all the width they
        # leave); alone, a prompt always takes the whole width. Smaller: the running streams' steps are
        # shorter, the new prompt's first token later (bench/serve_prefill.py measures both)
        self.budget = Budget(session.max_step_tokens, session.max_seqs, prefill_chunk, bool(self.block), cells,
                             prefix_cache=session.prefix_cache is not None)
        # every request the engine holds (waiting, running, or done until its sequence is released), in
        # arrival order, and its slot in the schedule
        self.requests: dict[int, Request] = {}
        self.slots: dict[int, Slot] = {}
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.error: BaseException | None = None  # what killed the loop, if anything did

    @property
    def waiting(self) -> list[Request]:
        """The requests waiting for a sequence, oldest first."""
        with self._lock:
            return [self.requests[rid] for rid, slot in self.slots.items() if slot.state is State.WAITING]

    @property
    def running(self) -> dict[int, Request]:
        """The requests that hold a sequence (one that ended holds it until the next iteration)."""
        with self._lock:
            return {rid: self.requests[rid] for rid, slot in self.slots.items() if slot.state is not State.WAITING}

    def _count(self, *states: State) -> int:
        with self._lock:
            return sum(slot.state in states for slot in self.slots.values())

    # --- the HTTP side (any thread) ---

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, request: Request) -> None:
        """Queue ``request``; ``Overloaded`` when ``max_queue`` requests already wait for a sequence (those
        that a free sequence will take at the next iteration do not count), nothing done."""
        with self._lock:
            waiting = self._count(State.WAITING)
            free = self.session.max_seqs - self._count(State.PREFILLING, State.DECODING)
            if waiting - free >= self.max_queue:
                raise Overloaded(f"{waiting - free} requests are waiting for a sequence, the server's --max-queue")
            self.slots[request.id] = Slot(request.id, request.prompt, cells=self.needs(request))
            self.requests[request.id] = request
            self.metrics.queue_depth.set(waiting + 1)
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: released at the next iteration."""
        request.cancel()

    def status(self) -> tuple[int, int]:
        """(sequences held, waiting requests)."""
        return self._count(State.PREFILLING, State.DECODING, State.DONE), self._count(State.WAITING)

    def count_rejected(self) -> None:
        self.metrics.requests.labels(outcome="rejected").inc()

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def needs(self, request: Request) -> int:
        """Rows of KV the request may take: its prompt, its tokens and a draft block past them."""
        return len(request.prompt) + request.max_tokens + self.block

    # --- the engine thread ---

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._stop and not self.slots:
                        self._lock.wait(timeout=0.5)
                    if self._stop:
                        break
                self.iterate()
        except BaseException as err:  # the loop is dead: every request gets an error, /ready says so
            self.error = err
            log.exception("engine loop failed")
            with self._lock:
                held = [r for r in self.requests.values() if not r.finished]
            for request in held:
                self._finish(request, "error", error=(500, f"the engine stopped: {err}", "engine_failed"))
            raise

    def iterate(self) -> None:
        """One iteration: drop, plan, release, admit, step, speculate (module docstring)."""
        self._drop_ended()
        with self._lock:
            plan = schedule.plan(list(self.slots.values()), self.budget)
        self._release(plan.released)
        self._admit(plan)
        feeds = {rid: toks for rid, toks in plan.feeds.items() if self._live(rid)}
        if feeds:  # (without the admitted requests that could not join: they ended)
            self._step(feeds)
        if plan.speculate:
            self._speculate(plan.speculate)
        self.metrics.live_sequences.set(self._count(State.PREFILLING, State.DECODING))

    def _drop_ended(self) -> None:
        """Finish the requests whose client went away or whose deadline passed."""
        now = time.monotonic()
        with self._lock:
            held = [r for r in self.requests.values() if not r.finished]
        for request in held:
            if request.cancelled:
                self._finish(request, "cancelled")
            elif request.deadline is not None and now > request.deadline:
                self._finish(request, "timeout", error=(408, "the request took longer than the server's --request-timeout "
                                                        f"of {request.deadline - request.arrived:.1f} s", "timeout"))

    def _live(self, rid: int) -> bool:
        slot = self.slots.get(rid)
        return slot is not None and slot.state in (State.PREFILLING, State.DECODING)

    def _release(self, slots: list[Slot]) -> None:
        for slot in slots:
            self.session.release(slot.id)
            with self._lock:
                del self.slots[slot.id], self.requests[slot.id]

    def _admit(self, plan: schedule.Plan) -> None:
        """Give each admitted request its sequence (from a released one's rows where the plan lets it), its
        images and its token policy."""
        for slot in plan.admitted:
            request = self.requests[slot.id]
            request.chooser = policy(request.params)
            self.metrics.prompt_tokens.inc(len(request.prompt))
            if (refused := self._join(request, slot, plan)) is not None:
                self._finish(request, "error", error=refused)
        self.metrics.queue_depth.set(self._count(State.WAITING))

    def _join(self, request: Request, slot: Slot, plan: schedule.Plan) -> tuple[int, str, str] | None:
        """Add the request's sequence and encode its images; None, or the (status, message, code) of
        what the session refused: a sequence it could not add is about the request, an image it could
        not take about the image, unless the image would pass the context or the program failed."""
        try:
            request.cached = self.session.add(request.id, plan.prefixes.get(slot.id, ()), request.images)
        except SessionError as err:
            return 400, str(err), "invalid_request"  # (it holds no sequence: still waiting, it is forgotten)
        plan.admit(slot, request.cached)
        self.metrics.count_prefill(len(request.prompt), request.cached, self.budget.prefix_cache)
        for image in request.images:
            try:
                self.session.add_image(request.id, image)
            except SessionError as err:
                if not self.session.vision:
                    return 400, str(err), "invalid_request"  # images sent to an artifact of text only
                if err.__cause__ is not None:  # the encoder failed, not the image
                    return 500, str(err), "image_encoding_failed"
                if "past the context" in str(err):
                    return 400, str(err), "context_length_exceeded"
                return 400, str(err), "invalid_image"
        return None

    def _step(self, feeds: dict[int, list[int]]) -> None:
        start = time.monotonic()
        try:
            logits = self.session.step(feeds)
        except SessionError as err:
            log.error("step of requests %s failed: %s", sorted(feeds), err)
            for rid in feeds:
                self._finish(self.requests[rid], "error", error=(500, f"the model step failed: {err}", "step_failed"))
            return
        self.metrics.step_seconds.observe(time.monotonic() - start)
        for rid, toks in feeds.items():
            slot, request = self.slots[rid], self.requests[rid]
            if not slot.took(len(toks)):
                continue  # a prompt chunk short of the prompt's end
            row = logits[rid]
            slot.next_token = request.chooser.sample(row)
            self._give(request, [(slot.next_token, row)])

    def _speculate(self, feeds: dict[int, int]) -> None:
        start = time.monotonic()
        requests = [self.requests[rid] for rid in feeds]
        try:
            rounds = self.session.speculate(feeds, policies={r.id: r.chooser for r in requests})
        except SessionError as err:
            log.error("speculative round of requests %s failed: %s", sorted(feeds), err)
            for request in requests:
                self._finish(request, "error", error=(500, f"the speculative step failed: {err}", "step_failed"))
            return
        self.metrics.step_seconds.observe(time.monotonic() - start)
        for request in requests:
            result = rounds[request.id]
            kept = len(result.tokens) - 1
            request.rounds += 1
            request.proposed += len(result.proposals)
            request.accepted += kept
            self.metrics.spec_proposed.inc(len(result.proposals))
            self.metrics.spec_accepted.inc(kept)
            self.slots[request.id].next_token = result.tokens[-1]
            self._give(request, [(t, result.logits[i]) for i, t in enumerate(result.tokens)])

    def _give(self, request: Request, tokens: list) -> None:
        """Append the chosen tokens (with the logits each was chosen from) to ``request`` until it ends;
        send the new text; finish it when it stopped."""
        now = time.monotonic()
        out, finish = [], None
        for token, logits in tokens:
            request.generated.append(token)
            self.metrics.generation_tokens.inc()
            if request.first_token_at is None:
                request.first_token_at = now
                self.metrics.ttft_seconds.observe(now - request.arrived)
            else:
                self.metrics.itl_seconds.observe((now - request.last_token_at) / len(tokens))
            logprob, top = (top_logprobs(logits, token, request.logprobs) if request.logprobs is not None else (None, []))
            out.append(Token(token, logprob, top))
            if token in self.eos and not request.ignore_eos:
                finish = "stop"
                break
            if len(request.generated) >= request.max_tokens:
                finish = "length"
                break
        request.last_token_at = now
        text_ids = [t.id for t in out if request.ignore_eos or t.id not in self.eos]
        new, finish = request.detokenize(self.session.tokenizer, text_ids, finish)
        request.emit(Event("tokens", out, new))
        if finish is not None:
            self._finish(request, finish)

    def _finish(self, request: Request, outcome: str, error: tuple | None = None) -> None:
        """End ``request``: one without a sequence is forgotten, one with a sequence is done (the next
        iteration's plan releases it); count it, tell its client."""
        request.finished = True
        with self._lock:
            slot = self.slots.get(request.id)
            if slot is not None and slot.state is State.WAITING:
                del self.slots[request.id], self.requests[request.id]
                self.metrics.queue_depth.set(self._count(State.WAITING))
            elif slot is not None:
                slot.finish()
        self.metrics.live_sequences.set(self._count(State.PREFILLING, State.DECODING))
        self.metrics.requests.labels(outcome=outcome).inc()
        if error is not None:
            status, message, code = error
            request.emit(Event("error", status=status, message=message, code=code))
        elif outcome != "cancelled":
            request.emit(Event("done", finish_reason=outcome, usage=request.usage()))
