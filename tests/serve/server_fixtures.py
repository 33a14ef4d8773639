"""A real server (``python -m pipeline.serve``, its own process) on 127.0.0.1 at a free port, over
artifacts built once per test session; plain-HTTP helpers on the standard library."""

import contextlib
import http.client
import json
import socket
import subprocess
import sys
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
    model: str

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(artifact: Path, tmp: Path, *args: str):
    port = free_port()
    log = tmp / f"serve-{port}.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-m", "pipeline.serve", str(artifact), "--port", str(port),
                                    "--api-key", API_KEY, "--model-name", "tiny", *args], stdout=out, stderr=subprocess.STDOUT)
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
        yield Server(f"http://127.0.0.1:{port}", port, process, log, "tiny")
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


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
