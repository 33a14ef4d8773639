# ruff: noqa: F811  (the fixtures imported from server_fixtures are parameters of the tests)
"""The engine process seen from the server: SIGKILLed mid-stream, every open request ends with an error
event; while it is down a request is refused with 503 and an error object, and ``/health`` and
``/ready`` say why; it is restarted, and the next request gets the text it got before; when the
restarts are spent the server exits 4. One event callback that raises keeps no other request from its
events."""

import os
import signal
import time

from pipeline.runtime.sampling import SamplingParams
from pipeline.serve.request import Request
from server_fixtures import API_KEY, Stream, chat_artifact, engine_pid, request, running_server  # noqa: F401

ERROR_KEYS = {"message", "type", "param", "code"}


def wait_ready(server, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while server.get("/ready")[0] != 200:
        assert server.process.poll() is None, server.log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"the server was not ready again in {timeout} s:\n{server.log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_a_killed_engine_process_ends_its_requests_is_refused_while_down_and_restarted(chat_artifact, tmp_path):
    with running_server(chat_artifact, tmp_path, "--engine-restarts", "1", model_name=None) as s:
        status, models = request(s.port, "GET", "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert status == 200 and [m["id"] for m in models["data"]] == ["chat4"]  # the build's experiment_name
        greedy = {"model": "chat4", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
        status, before = s.post("/v1/completions", greedy)
        assert status == 200 and before["model"] == "chat4" and before["choices"][0]["text"]
        first = engine_pid(s.process.pid)

        streams = [Stream(s.port, {"model": "chat4", "prompt": f"Story {i}:", "max_tokens": 1200, "temperature": 0})
                   for i in range(3)]
        for stream in streams:
            assert len(stream.read(2)) == 2  # each is generating
        os.kill(first, signal.SIGKILL)
        for stream in streams:
            events = stream.read()
            stream.close()
            assert events[-1] == "[DONE]", events[-3:]
            assert set(events[-2]) == {"error"} and set(events[-2]["error"]) == ERROR_KEYS, events[-2]
            assert events[-2]["error"]["code"] == "engine_failed"
            assert not any(e["choices"][0]["finish_reason"] for e in events[:-2]), "a stream finished before the kill"

        # down: the restart waits a second and then loads the artifact (seconds more)
        status, error = s.post("/v1/completions", greedy)
        assert status == 503 and set(error["error"]) == ERROR_KEYS and error["error"]["code"] == "engine_unavailable", error
        assert "killed by SIGKILL" in error["error"]["message"]
        status, ready = s.get("/ready")
        assert status == 503 and "killed by SIGKILL" in ready["error"] and "restart 1 of 1" in ready["error"], ready
        status, health = s.get("/health")
        assert status == 503 and health["status"] != "ok" and "killed by SIGKILL" in health["error"], health
        assert s.metric("pipeline_engine_up") == 0

        wait_ready(s)
        assert engine_pid(s.process.pid) != first
        assert s.get("/health") == (200, {"status": "ok"})
        status, after = s.post("/v1/completions", greedy)
        assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"]
        assert s.metric("pipeline_engine_restarts_total") == 1 and s.metric("pipeline_engine_up") == 1
        assert "restarting the engine process (restart 1 of 1, --engine-restarts)" in s.log.read_text()

        os.kill(engine_pid(s.process.pid), signal.SIGKILL)  # the restarts are spent: the server exits 4
        assert s.process.wait(timeout=60) == 4, s.log.read_text()[-3000:]
        assert "its restarts are spent (--engine-restarts 1): the server exits" in s.log.read_text()


def test_one_raising_callback_does_not_keep_the_others_from_their_events(chat_artifact):
    from pipeline.serve.worker import EngineProcess

    engine = EngineProcess(chat_artifact, max_queue=8)
    engine.start()
    try:
        events: dict[int, list] = {0: [], 1: [], 2: []}

        def raising(event):
            events[1].append(event)
            raise RuntimeError("a planted failure of a client's callback")

        requests = [Request([100 + i, 200, 300], n, SamplingParams(temperature=0), emit=emit)
                    for i, (n, emit) in enumerate(((24, events[0].append), (1000, raising), (24, events[2].append)))]
        for request in requests:
            engine.submit(request)
        deadline = time.monotonic() + 60
        while engine.requests and time.monotonic() < deadline:  # each ended (the raising one: cancelled)
            time.sleep(0.02)
        assert not engine.requests and engine.alive
        for i in (0, 2):
            assert events[i][-1].kind == "done" and events[i][-1].usage["completion_tokens"] >= 1, events[i][-1:]
        assert events[1] and all(e.kind == "tokens" for e in events[1])  # its events raised: it was cancelled
    finally:
        engine.stop()
