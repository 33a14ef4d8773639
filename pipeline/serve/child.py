"""The engine process's side of ``worker.py``'s pipe: load the artifact's session, say ready, run the
engine thread, and serve the parent's messages (the protocol is in ``worker.py``)."""

import logging
import threading

from pipeline.serve.request import Event, Request

log = logging.getLogger("pipeline.serve")


def main(artifact: str, conn, prefill_chunk: int | None, prefix_cache: bool = True) -> None:
    """The engine process: load the session (``prefix_cache``: released sequences' rows kept for prompts
    that start alike), say ready, run the engine thread, serve the pipe."""
    from pipeline.quiet import filtered_stderr

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s (engine): %(message)s")

    try:
        with filtered_stderr():
            from pipeline.build.roles import EMBED, TARGET_STEP
            from pipeline.runtime.session import Session
            from pipeline.serve.engine import Engine
            from pipeline.serve.metrics import Metrics

            session = Session(artifact, prefix_cache=prefix_cache)
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

    def deliver(rid: int, event: Event) -> None:
        try:
            send(("event", rid, event))
        except Exception:  # noqa: BLE001  (called from the engine thread: an event that cannot be sent fails no other request)
            log.exception("sending a %r event of request %d to the server failed", event.kind, rid)

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
            request.emit = lambda event, rid=rid: deliver(rid, event)
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

