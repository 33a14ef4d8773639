"""The engine in a process of its own, so that the HTTP side never waits on a model step.

ExecuTorch's ``Method.execute`` holds the GIL for the whole program call: an engine *thread* beside the
event loop stalls every other request, ``/health`` included, for as long as a step runs (334 ms p50,
912 ms at worst while SmolLM2 prefilled a 1,000-token prompt; ``bench/serve_prefill.py``). So the
server runs the ``Engine`` in a child process (``spawn``: the parent never imports the runtime) and
talks to it over a pipe (the child's side: ``child.py``):

    parent -> child   ("submit", id, fields) | ("cancel", id) | ("metrics", n) | ("rejected",) | ("stop",)
    child -> parent   ("ready", info) | ("failed", message) | ("event", id, Event) | ("status", running, waiting)
                      | ("ended", id) | ("metrics", n, bytes) | ("dead", error)

``EngineProcess`` has the in-process ``Engine``'s interface for the app (``submit``, ``cancel``,
``status``, ``count_rejected``, ``render_metrics``, ``alive``, ``error``, ``context_limit``); a reader
thread hands each event to its request's ``emit`` (one callback that raises is logged, and its request
cancelled; the others still get theirs). If the child dies (killed, or its engine thread failed), every
request in flight gets an ``engine_failed`` error, ``alive`` is false (the app answers 503, ``/health``
and ``/ready`` say why), and the reader starts another child over the artifact, at most ``restarts``
times in the server's life; when they are spent it calls ``on_exhausted`` (the server exits non-zero
for its supervisor to start it afresh).
"""

import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable

from pipeline.errors import SessionError
from pipeline.serve.child import main as engine_main
from pipeline.serve.engine import Overloaded
from pipeline.serve.metrics import ProcessMetrics
from pipeline.serve.request import Event, Request

log = logging.getLogger("pipeline.serve")
FIELDS = ("prompt", "max_tokens", "params", "stop", "logprobs", "images", "deadline", "arrived")
# seconds between a child's death and the start of the next: the dead one's memory is back to the
# system (an out-of-memory kill) before another loads the program
RESTART_DELAY_S = 1.0


def tell(request: Request, event: Event) -> bool:
    """Hand ``event`` to ``request``'s callback; one that raises is logged (False), so that the caller goes
    on delivering to the other requests."""
    try:
        request.emit(event)
    except Exception:  # noqa: BLE001  (whatever a client's callback raises, the others still get theirs)
        log.exception("delivering a %r event to request %d failed", event.kind, request.id)
        return False
    return True


class EngineProcess:
    """The engine of ``artifact`` in a child process, seen from the HTTP side; a dead child is replaced
    ``restarts`` times (module docstring)."""

    def __init__(self, artifact: str, max_queue: int, prefill_chunk: int | None = None, startup_timeout: float = 600,
                 restarts: int = 0, restart_delay: float = RESTART_DELAY_S, prefix_cache: bool = True):
        self.artifact, self.prefill_chunk, self.startup_timeout = str(artifact), prefill_chunk, startup_timeout
        self.prefix_cache = prefix_cache
        self.max_queue = max_queue
        self.restarts, self.restart_delay = restarts, restart_delay
        self.restarted = 0  # children started after the first
        self.on_exhausted: Callable[[str], None] | None = None  # called from the reader when the restarts are spent
        self.requests: dict[int, Request] = {}
        self.running, self.waiting = 0, 0  # as the child last said (after each of its iterations)
        self.error: str | None = None  # why nothing is served now; None while the child serves
        self.metrics = ProcessMetrics()
        self._stopping = threading.Event()
        self._send_lock = threading.Lock()
        self._replies: dict[int, list] = {}
        self._reply_ids = itertools.count()
        info = self._spawn()
        self.context_limit, self.max_seqs = info["context_limit"], info["max_seqs"]
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)

    def _spawn(self) -> dict:
        """Start a child over the artifact and wait until it has loaded it; its ``ready`` info."""
        context = multiprocessing.get_context("spawn")
        conn, child_end = context.Pipe()
        process = context.Process(target=engine_main, args=(self.artifact, child_end, self.prefill_chunk, self.prefix_cache), name="engine",
                                  daemon=True)
        process.start()
        child_end.close()
        if not conn.poll(self.startup_timeout):
            process.kill()
            raise SessionError(f"the engine process did not load {self.artifact} in {self.startup_timeout:.0f} s")
        try:
            kind, info = conn.recv()
        except EOFError:
            process.join(timeout=5)
            raise SessionError(f"the engine process died loading {self.artifact} ({_exit(process.exitcode)})") from None
        if kind == "failed":
            raise SessionError(info)
        with self._send_lock:
            old, (self._conn, self._process) = getattr(self, "_conn", None), (conn, process)
        if old is not None:  # the dead child's end
            old.close()
        self.metrics.engine_up.set(1)
        log.info("the engine process (pid %d) loaded %s", process.pid, self.artifact)
        return info

    def start(self) -> None:
        self._reader.start()

    def stop(self) -> None:
        self._stopping.set()
        self._send(("stop",))
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping.is_set() and self._process.is_alive()

    def submit(self, request: Request) -> None:
        """Queue ``request`` in the child; ``Overloaded`` (nothing sent) when ``max_queue`` requests would
        wait for a sequence: the requests in flight beyond the artifact's ``max_seqs``; ``SessionError``
        while the engine is down."""
        with self._send_lock:
            if not self.alive:
                raise SessionError(f"the engine is not running: {self.error or 'it exited'}")
            if len(self.requests) - self.max_seqs >= self.max_queue:
                raise Overloaded(f"{len(self.requests) - self.max_seqs} requests are waiting for a sequence, "
                                 "the server's --max-queue")
            self.requests[request.id] = request
            try:
                self._conn.send(("submit", request.id, {name: getattr(request, name) for name in FIELDS}))
            except (OSError, ValueError):  # the child is gone and the reader has not said so yet
                del self.requests[request.id]
                raise SessionError("the engine is not running: its process exited") from None

    def cancel(self, request: Request) -> None:
        if request.id in self.requests:
            self._send(("cancel", request.id))

    def status(self) -> tuple[int, int]:
        """(live sequences, waiting requests), as the child said after its last iteration."""
        return self.running, self.waiting

    def count_rejected(self) -> None:
        self._send(("rejected",))

    def render_metrics(self) -> bytes:
        """The child's metrics (while it serves) and the parent's own (``pipeline_engine_up``, restarts)."""
        own = self.metrics.render()
        if not self.alive:
            return own
        try:
            return self.call("metrics") + own
        except SessionError:  # it died meanwhile
            return own

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
        with self._send_lock:  # as _down: a call registered after it would wait for nothing
            if not self.alive:
                raise SessionError(f"the engine is not running: {self.error or 'it exited'}")
            self._replies[n] = [box, done]
            try:
                self._conn.send((kind, n))
            except (OSError, ValueError):
                self._replies.pop(n, None)
                raise SessionError("the engine is not running: its process exited") from None
        if not done.wait(timeout):
            self._replies.pop(n, None)
            raise SessionError(f"the engine process did not answer {kind!r} in {timeout:.0f} s")
        if not box:
            raise SessionError(f"the engine process exited before answering {kind!r}")
        return box[0]

    # --- the reader thread ---

    def _read(self) -> None:
        """Relay the child's messages; when it dies, fail its requests and start another (``restarts``)."""
        while True:
            reason = self._relay()
            if self._stopping.is_set():
                return
            self._down(reason)
            if not self._restart(reason):
                return

    def _relay(self) -> str:
        """Hand the child's messages on until it is gone; why it is."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "event":
                    self._deliver(message[1], message[2])
                elif kind == "status":
                    self.running, self.waiting = message[1], message[2]
                elif kind == "dead":  # the engine thread failed (its requests were told): this child serves nothing more
                    self._process.kill()
                    self._process.join(timeout=5)
                    return f"the engine failed: {message[1]}"
                elif kind == "ended":  # a request the child dropped without telling its client (cancelled)
                    self.requests.pop(message[1], None)
                elif kind == "metrics":
                    box, done = self._replies.pop(message[1], (None, None))
                    if box is not None:
                        box.append(message[2])
                        done.set()
        except (EOFError, OSError):
            self._process.join(timeout=5)
            return f"the engine process exited ({_exit(self._process.exitcode)})"

    def _deliver(self, rid: int, event: Event) -> None:
        request = self.requests.get(rid)
        if request is None:
            return
        request.generated += [t.id for t in event.tokens]
        if event.kind != "tokens":
            self.requests.pop(rid, None)
        if not tell(request, event) and event.kind == "tokens":
            self.cancel(request)  # its client cannot take its events: free its sequence

    def _down(self, reason: str) -> None:
        """The child is gone: nothing more is submitted, each request in flight ends with an error, and
        a metrics call waiting for it returns."""
        with self._send_lock:
            self.error = reason
            failed = list(self.requests.values())
            self.requests.clear()
            self.running, self.waiting = 0, 0
            replies = list(self._replies.values())
            self._replies.clear()
        self.metrics.engine_up.set(0)
        log.error("%s; %d requests in flight end with an error", reason, len(failed))
        for _, done in replies:
            done.set()
        for request in failed:
            tell(request, Event("error", status=500, message=reason, code="engine_failed"))

    def _restart(self, reason: str) -> bool:
        """Start another child (a few seconds down while it loads), up to ``restarts`` in the server's
        life; False, ``on_exhausted`` called, when they are spent."""
        while self.restarted < self.restarts:
            self.restarted += 1
            self.error = f"{reason}; restarting it (restart {self.restarted} of {self.restarts}, --engine-restarts)"
            log.warning("restarting the engine process (restart %d of %d, --engine-restarts) after: %s",
                        self.restarted, self.restarts, reason)
            if self._stopping.wait(self.restart_delay):
                return False
            try:
                self._spawn()
            except SessionError as err:
                reason = f"the restarted engine process did not load: {err}"
                log.error(reason)
                continue
            self.metrics.engine_restarts.inc()
            if self._stopping.is_set():  # the server stopped while the child loaded
                self._process.kill()
                return False
            self.error = None
            log.info("the engine process is back (restart %d of %d)", self.restarted, self.restarts)
            return True
        self.error = f"{reason}; its restarts are spent (--engine-restarts {self.restarts}): the server exits"
        log.critical(self.error)
        if self.on_exhausted is not None:
            self.on_exhausted(self.error)
        return False


def _exit(code: int | None) -> str:
    """How a child ended, as ``Process.exitcode`` says it (negative: the signal that killed it)."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
