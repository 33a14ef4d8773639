"""The engine in a process of its own, so that the HTTP side never waits on a model step.

ExecuTorch's ``Method.execute`` holds the GIL for the whole program call: an engine *thread* beside the
event loop stalls every other request, ``/health`` included, for as long as a step runs (334 ms p50,
912 ms at worst while SmolLM2 prefilled a 1,000-token prompt; ``bench/serve_prefill.py``). So the
server runs the ``Engine`` in a child process (``spawn``: the parent never imports the runtime) and
talks to it over a pipe:

    parent -> child   ("submit", id, fields) | ("cancel", id) | ("metrics", n) | ("rejected",) | ("stop",)
    child -> parent   ("ready", info) | ("failed", message) | ("event", id, Event) | ("status", running, waiting)
                      | ("ended", id) | ("metrics", n, bytes) | ("dead", error)

``EngineProcess`` has the in-process ``Engine``'s interface for the app (``submit``, ``cancel``,
``status``, ``count_rejected``, ``render_metrics``, ``alive``, ``error``, ``context_limit``); a reader thread hands each event to its request's
``emit``. If the child dies, every request in flight gets an error and ``/ready`` says so.
"""

import itertools
import logging
import multiprocessing
import threading

from pipeline.errors import SessionError
from pipeline.serve.engine import Overloaded
from pipeline.serve.request import Event, Request

log = logging.getLogger("pipeline.serve")
FIELDS = ("prompt", "max_tokens", "params", "stop", "logprobs", "images", "deadline", "arrived")


class EngineProcess:
    """The engine of ``artifact`` in a child process, seen from the HTTP side."""

    def __init__(self, artifact: str, max_queue: int, prefill_chunk: int | None = None, startup_timeout: float = 600):
        self.max_queue = max_queue
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child, args=(str(artifact), child, prefill_chunk), name="engine", daemon=True)
        self._process.start()
        child.close()
        if not self._conn.poll(startup_timeout):
            self._process.kill()
            raise SessionError(f"the engine process did not load {artifact} in {startup_timeout:.0f} s")
        try:
            kind, info = self._conn.recv()
        except EOFError:
            raise SessionError(f"the engine process died loading {artifact} (exit code {self._process.exitcode})") from None
        if kind == "failed":
            raise SessionError(info)
        self.context_limit, self.max_seqs = info["context_limit"], info["max_seqs"]
        self.requests: dict[int, Request] = {}
        self.running, self.waiting = 0, 0  # as the child last said (after each of its iterations)
        self.error: str | None = None
        self._send_lock = threading.Lock()
        self._replies: dict[int, list] = {}
        self._reply_ids = itertools.count()
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def stop(self) -> None:
        self._send(("stop",))
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()

    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self.error is None

    def submit(self, request: Request) -> None:
        """Queue ``request`` in the child; ``Overloaded`` (nothing sent) when ``max_queue`` requests would
        wait for a sequence: the requests in flight beyond the artifact's ``max_seqs``."""
        with self._send_lock:
            if len(self.requests) - self.max_seqs >= self.max_queue:
                raise Overloaded(f"{len(self.requests) - self.max_seqs} requests are waiting for a sequence, "
                                 "the server's --max-queue")
            if not self.alive:
                raise SessionError(f"the engine process is not running ({self.error or 'it exited'})")
            self.requests[request.id] = request
            self._conn.send(("submit", request.id, {name: getattr(request, name) for name in FIELDS}))

    def cancel(self, request: Request) -> None:
        if request.id in self.requests:
            self._send(("cancel", request.id))

    def status(self) -> tuple[int, int]:
        """(live sequences, waiting requests), as the child said after its last iteration."""
        return self.running, self.waiting

    def count_rejected(self) -> None:
        self._send(("rejected",))

    def render_metrics(self) -> bytes:
        return self.call("metrics")

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the child is gone: the reader reports it
                pass

    def call(self, kind: str, timeout: float = 60):
        """A round trip to the child (answered between two of its steps)."""
        n = next(self._reply_ids)
        box: list = []
        done = threading.Event()
        self._replies[n] = [box, done]
        self._send((kind, n))
        if not done.wait(timeout):
            self._replies.pop(n, None)
            raise SessionError(f"the engine process did not answer {kind!r} in {timeout:.0f} s")
        return box[0]

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "event":
                    _, rid, event = message
                    request = self.requests.get(rid)
                    if request is None:
                        continue
                    request.generated += [t.id for t in event.tokens]
                    if event.kind != "tokens":
                        self.requests.pop(rid, None)
                    request.emit(event)
                elif kind == "status":
                    self.running, self.waiting = message[1], message[2]
                elif kind == "dead":  # the engine thread failed: its requests were told; nothing more is served
                    self.error = f"the engine failed: {message[1]}"
                    log.error(self.error)
                elif kind == "ended":  # a request the child dropped without telling its client (cancelled)
                    self.requests.pop(message[1], None)
                elif kind in ("metrics",):
                    box, done = self._replies.pop(message[1], (None, None))
                    if box is not None:
                        box.append(message[2])
                        done.set()
        except (EOFError, OSError) as err:
            self.error = f"the engine process exited (code {self._process.exitcode}; {type(err).__name__})"
            log.error(self.error)
            for rid, request in list(self.requests.items()):
                self.requests.pop(rid, None)
                request.emit(Event("error", status=500, message=self.error, code="engine_failed"))


def _child(artifact: str, conn, prefill_chunk: int | None) -> None:
    """The engine process: load the session, say ready, run the engine thread, serve the pipe."""
    from pipeline.quiet import filtered_stderr

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s (engine): %(message)s")

    try:
        with filtered_stderr():
            from pipeline.build.roles import EMBED, TARGET_STEP
            from pipeline.runtime.session import Session
            from pipeline.serve.engine import Engine
            from pipeline.serve.metrics import Metrics

            session = Session(artifact)
            for method in (EMBED, TARGET_STEP):  # loaded before the first request, not during it
                session.method(method)
            session.tokenizer  # noqa: B018  (loaded now, not at the first token)
    except Exception as err:  # noqa: BLE001  (the parent reports it and exits 2)
        conn.send(("failed", f"loading {artifact}: {err}"))
        return
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    class Reporting(Engine):
        def iterate(self) -> None:
            super().iterate()
            send(("status", len(self.running), len(self.waiting)))

        def _loop(self) -> None:
            try:
                super()._loop()
            finally:
                if self.error is not None:
                    send(("dead", str(self.error)))

        def _finish(self, request, outcome, error=None):
            super()._finish(request, outcome, error)
            if outcome == "cancelled":
                send(("ended", request.id))

    engine = Reporting(session, Metrics(), max_queue=1 << 30, prefill_chunk=prefill_chunk)  # the parent enforces --max-queue
    send(("ready", {"context_limit": engine.context_limit, "max_seqs": session.max_seqs}))
    engine.start()
    requests: dict[int, Request] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        kind = message[0]
        if kind == "submit":
            _, rid, fields = message
            request = Request(**fields, id=rid)
            request.emit = lambda event, rid=rid: send(("event", rid, event))
            requests[rid] = request
            engine.submit(request)
        elif kind == "cancel":
            if (request := requests.get(message[1])) is not None:
                request.cancel()
        elif kind == "metrics":
            send(("metrics", message[1], engine.metrics.render()))
        elif kind == "rejected":
            engine.metrics.requests.labels(outcome="rejected").inc()
        elif kind == "stop":
            break
        for rid in [rid for rid, r in requests.items() if r.finished]:
            del requests[rid]
    engine.stop()

