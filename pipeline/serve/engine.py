"""The engine: one thread owns the ``Session`` and runs continuous batching over it.

Each iteration of its loop:

1. drops what ended outside a step: requests whose client went away (cancelled) or whose
   ``--request-timeout`` passed, waiting or running; a running one's sequence is released;
2. admits waiting requests, oldest first, while the artifact has a free sequence (and, in a cell
   layout, the pool has cells for the request's prompt, its ``max_tokens`` and a draft block);
3. runs one target step that feeds every live sequence: one token of each decoding sequence and,
   in what is left of the step's ``max_step_tokens``, the next chunk of each prefilling prompt,
   oldest first (so a long prompt arriving never stops the streams already running: they keep
   their token per step, and the prompt takes the rest of the width). With a draft, decoding
   sequences take a speculative round instead, in a second program call of the same iteration;
4. chooses each sequence's next token with its own policy (greedy or its seeded sampler), checks
   end of sequence, stop strings and ``max_tokens``, sends the text, and releases a finished
   sequence in the same iteration.

A ``SessionError`` from a step fails the requests of that step only (the step is transactional:
the session is as it was), and the loop goes on. The HTTP side talks to the engine through
``submit`` (thread-safe, refuses beyond ``max_queue`` waiting requests) and each request's
``emit`` callback, which the engine calls from its thread.
"""

import collections
import logging
import threading
import time

from pipeline.errors import SessionError
from pipeline.runtime.sampling import policy, top_logprobs
from pipeline.serve.request import Event, Request, Token

log = logging.getLogger("pipeline.serve")


class Overloaded(Exception):
    """The queue is full: the request was refused before any work."""


class Engine:
    """Continuous batching over ``session`` in a thread of its own (module docstring)."""

    def __init__(self, session, metrics, max_queue: int = 64, eos: set[int] | None = None, prefill_chunk: int | None = None):
        self.session = session
        # prompt tokens a step takes while other sequences decode (None: all the width they leave); alone,
        # a prompt always takes the whole width. Smaller: the running streams' steps are shorter, the
        # new prompt's first token later (bench/serve_prefill.py measures both)
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics
        self.max_queue = max_queue
        eos_id = session.tokenizer.eos_token_id
        self.eos = eos if eos is not None else ({eos_id} if eos_id is not None else set())
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}
        self.block = session.speculation.block_size if session.speculation else 0
        self._cells = getattr(session.pool, "n_cells", None)  # a cell layout's shared pool: admission reserves cells
        # the most tokens (prompt + max_tokens) one request may take: the sequence's context, or the pool
        # less a draft block; None: unbounded (a model of ring layers only)
        self.context_limit = session.max_length if self._cells is None else self._cells - self.block
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.error: BaseException | None = None  # what killed the loop, if anything did

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
            free = self.session.max_seqs - len(self.running)
            if len(self.waiting) - free >= self.max_queue:
                raise Overloaded(f"{len(self.waiting) - free} requests are waiting for a sequence, the server's --max-queue")
            self.waiting.append(request)
            self.metrics.queue_depth.set(len(self.waiting))
            self._lock.notify()

    def cancel(self, request: Request) -> None:
        """The client went away: released at the next iteration."""
        request.cancel()

    def status(self) -> tuple[int, int]:
        """(live sequences, waiting requests)."""
        return len(self.running), len(self.waiting)

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
                    while not self._stop and not self.waiting and not self.running:
                        self._lock.wait(timeout=0.5)
                    if self._stop:
                        break
                self.iterate()
        except BaseException as err:  # the loop is dead: every request gets an error, /ready says so
            self.error = err
            log.exception("engine loop failed")
            for request in [*self.waiting, *self.running.values()]:
                self._finish(request, "error", error=(500, f"the engine stopped: {err}", "engine_failed"))
            raise

    def iterate(self) -> None:
        """One iteration: drop, admit, step, choose, finish (module docstring)."""
        now = time.monotonic()
        with self._lock:
            waiting = list(self.waiting)
        for request in waiting + list(self.running.values()):
            if request.cancelled:
                self._finish(request, "cancelled")
            elif request.deadline is not None and now > request.deadline:
                self._finish(request, "timeout", error=(408, "the request took longer than the server's --request-timeout "
                                                        f"of {request.deadline - request.arrived:.1f} s", "timeout"))
        self._admit()
        if not self.running:
            return
        decoding = [r for r in self.running.values() if not r.prefilling]
        speculating = decoding if self.block else []
        feeds, width = {}, self.session.max_step_tokens
        if not speculating:
            feeds = {r.id: [r.generated[-1]] for r in decoding}
        room = width - len(feeds)
        if feeds and self.prefill_chunk is not None:
            room = min(room, self.prefill_chunk)
        if len(feeds) <= width:  # a step wider than max_step_tokens is a decode step only
            for r in sorted((r for r in self.running.values() if r.prefilling), key=lambda r: r.arrived):
                if room <= 0:
                    break
                chunk = r.prompt[r.fed: r.fed + room]
                feeds[r.id] = chunk
                room -= len(chunk)
        if feeds:
            self._step(feeds)
        if speculating:
            self._speculate([r for r in speculating if r.id in self.running])
        self.metrics.live_sequences.set(len(self.running))

    def _admit(self) -> None:
        with self._lock:
            while self.waiting and len(self.running) < self.session.max_seqs:
                request = self.waiting[0]
                if self._cells is not None and sum(map(self.needs, self.running.values())) + self.needs(request) > self._cells:
                    break  # the cell pool could not hold it to its end: it waits for cells
                self.waiting.popleft()
                self.running[request.id] = request
            self.metrics.queue_depth.set(len(self.waiting))
        for request in [r for r in self.running.values() if r.fed == 0 and r.chooser is None]:
            request.chooser = policy(request.params)
            try:
                self.session.add(request.id)
                for image in request.images:
                    self.session.add_image(request.id, image)
            except SessionError as err:
                self._finish(request, "error", error=(400, str(err), "invalid_image"))
            self.metrics.prompt_tokens.inc(len(request.prompt))

    def _step(self, feeds: dict[int, list[int]]) -> None:
        start = time.monotonic()
        try:
            logits = self.session.step(feeds)
        except SessionError as err:
            log.error("step of requests %s failed: %s", sorted(feeds), err)
            for rid in feeds:
                self._finish(self.running[rid], "error", error=(500, f"the model step failed: {err}", "step_failed"))
            return
        self.metrics.step_seconds.observe(time.monotonic() - start)
        for rid, toks in feeds.items():
            request = self.running[rid]
            if request.prefilling:
                request.fed += len(toks)
                if request.prefilling:
                    continue
            row = logits[rid]
            token = request.chooser.sample(row)
            self._give(request, [(token, row)])

    def _speculate(self, requests: list[Request]) -> None:
        start = time.monotonic()
        try:
            rounds = self.session.speculate({r.id: r.generated[-1] for r in requests},
                                            policies={r.id: r.chooser for r in requests})
        except SessionError as err:
            log.error("speculative round of requests %s failed: %s", [r.id for r in requests], err)
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
            if token in self.eos:
                finish = "stop"
                break
            if len(request.generated) >= request.max_tokens:
                finish = "length"
                break
        request.last_token_at = now
        new, finish = request.detokenize(self.session.tokenizer, [t.id for t in out if t.id not in self.eos], finish)
        request.emit(Event("tokens", out, new))
        if finish is not None:
            self._finish(request, finish)

    def _finish(self, request: Request, outcome: str, error: tuple | None = None) -> None:
        """End ``request``: release its sequence (if it has one), count it, tell its client."""
        request.finished = True
        with self._lock:
            if request in self.waiting:
                self.waiting.remove(request)
                self.metrics.queue_depth.set(len(self.waiting))
        if self.running.pop(request.id, None) is not None and request.id in self.session.seqs:
            self.session.release(request.id)
        self.metrics.live_sequences.set(len(self.running))
        self.metrics.requests.labels(outcome=outcome).inc()
        if error is not None:
            status, message, code = error
            request.emit(Event("error", status=status, message=message, code=code))
        elif outcome != "cancelled":
            request.emit(Event("done", finish_reason=outcome, usage=request.usage()))
