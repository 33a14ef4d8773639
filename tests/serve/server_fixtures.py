"""A real server (``python -m pipeline.serve``, its own process) on 127.0.0.1 at a free port, over
artifacts built once per test session; the app over an in-process ``Engine`` in a thread of the test;
plain-HTTP helpers on the standard library."""

import contextlib
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

# the text artifact: random tiny weights with SmolLM2's tokenizer and chat template; 1,280 tokens of context
CHAT = ("model=tiny_chat", "kv.max_seqs=4", "kv.capacity=1280", "kv.max_step_tokens=64", "experiment_name=chat4")
# with a DFlash draft and a vision encoder (its placeholder token one the chat template never writes)
CHAT_DRAFT_VISION = ("model=tiny_chat", "draft=dflash", "vision=smolvlm_tiny", "vision.image_token_id=16", "kv.max_seqs=4",
                     "kv.capacity=256", "kv.max_step_tokens=32", "experiment_name=chat_dv4")
API_KEY = "test-key"


@dataclass
class Server:
    url: str
    port: int
    process: subprocess.Popen
    log: Path
    model: str | None  # the --model-name it was given (None: the name it gives itself)

    def get(self, path: str, timeout: float = 30) -> tuple[int, dict | str]:
        return request(self.port, "GET", path, timeout=timeout)

    def post(self, path: str, body, timeout: float = 60, headers: dict | None = None) -> tuple[int, dict]:
        return request(self.port, "POST", path, body, timeout, {"Authorization": f"Bearer {API_KEY}", **(headers or {})})

    def metric(self, name: str) -> float:
        """The value of one sample of /metrics (``name`` with its labels, as Prometheus writes it)."""
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError(f"/metrics has no {name}")


def request(port: int, method: str, path: str, body=None, timeout: float = 30, headers: dict | None = None):
    """(status, JSON body or text); ``body``: a dict (sent as JSON) or bytes (sent as they are)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw, kind = resp.status, resp.read(), resp.headers.get("content-type", "")
    except urllib.error.HTTPError as err:
        status, raw, kind = err.code, err.read(), err.headers.get("content-type", "")
    return status, (json.loads(raw) if "json" in kind else raw.decode())


def stream_events(port: int, body: dict, stop_after: int | None = None) -> list:
    """POST a streaming request and read its server-sent events (JSON payloads, then "[DONE]"); with
    ``stop_after``, close the connection after that many events (a client going away)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                 json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    try:
        for line in resp:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if payload == "[DONE]" or (stop_after is not None and len(events) >= stop_after):
                break
    finally:
        conn.sock.shutdown(socket.SHUT_RDWR) if stop_after is not None and conn.sock else None
        conn.close()
    return events


class Stream:
    """A streaming request whose server-sent events are read as far as the test asks."""

    def __init__(self, port: int, body: dict, timeout: float = 60):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                          json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.events: list = []

    def read(self, n: int | None = None) -> list:
        """The events so far, after reading ``n`` more (None: to "[DONE]" or the end of the stream)."""
        want = None if n is None else len(self.events) + n
        while want is None or len(self.events) < want:
            line = self.resp.readline()
            if not line:
                break
            line = line.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                if payload == "[DONE]":
                    break
        return self.events

    def close(self) -> None:
        self.conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(artifact: Path, tmp: Path, *args: str, model_name: str | None = "tiny"):
    """The server over ``artifact`` with ``args``, serving as ``model_name`` (None: the name it gives)."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    naming = ["--model-name", model_name] if model_name is not None else []
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pipeline.serve", str(artifact), "--port", str(port),
                                    "--api-key", API_KEY, *naming, *args], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the server exited with {process.returncode}:\n{log.read_text()}")
            with contextlib.suppress(OSError):
                if request(port, "GET", "/ready", timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"the server did not become ready in 180 s:\n{log.read_text()}")
            time.sleep(0.2)
        yield Server(f"http://127.0.0.1:{port}", port, process, log, model_name)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def engine_pid(server_pid: int) -> int:
    """The server's engine process: its child that multiprocessing spawned (not its resource tracker)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (proc / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == server_pid and b"spawn_main" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
    assert len(found) == 1, f"the server {server_pid} has {len(found)} engine processes: {found}"
    return found[0]


@contextlib.contextmanager
def app_server(engine, artifact: Path, settings):
    """``create_app`` over ``engine`` (an in-process ``Engine``, started) and ``artifact``'s tokenizer,
    served by uvicorn in a thread of the test at a free port; yields the port."""
    import uvicorn

    from pipeline.build.manifest import read, sections
    from pipeline.build.roles import TARGET
    from pipeline.serve.app import create_app
    from pipeline.serve.prompts import Prompts

    vocab_size = sections(read(artifact))[TARGET]["vocab_size"]
    app = create_app(engine, Prompts(engine.session.tokenizer, None, vocab_size), settings)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the app did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def chat_artifact(build_dir) -> Path:
    return build_dir(*CHAT)


@pytest.fixture(scope="session")
def server(chat_artifact, tmp_path_factory):
    with running_server(chat_artifact, tmp_path_factory.mktemp("serve")) as s:
        yield s


@pytest.fixture(scope="session")
def draft_vision_artifact(build_dir) -> Path:
    return build_dir(*CHAT_DRAFT_VISION)


@pytest.fixture(scope="session")
def draft_server(draft_vision_artifact, tmp_path_factory):
    with running_server(draft_vision_artifact, tmp_path_factory.mktemp("serve")) as s:
        yield s
