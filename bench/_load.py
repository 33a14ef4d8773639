"""A load generator for OpenAI-compatible servers (ours and llama.cpp's alike): concurrent clients, each
a thread with its own HTTP connection, streaming ``/v1/completions``; per request the time to the
first token, the gaps between tokens and the tokens generated; optionally some clients hang up
mid-stream. Standard library only, so it loads both servers the same way."""

import http.client
import json
import math
import os
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool = False
    finish_reason: str | None = None
    ttft: float | None = None
    gaps: list = field(default_factory=list)  # seconds between streamed tokens
    tokens: int = 0
    seconds: float = 0.0
    disconnected: bool = False
    error: str | None = None
    max_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them (its usage), when it reports usage
    cached_tokens: int = 0  # of those, taken from the server's prompt cache (llama-server reports it)


def sse_events(resp):
    """The JSON events of a streamed OpenAI response, up to ``[DONE]``."""
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def stop_process(process: subprocess.Popen, log) -> None:
    """A server started by a benchmark stopped (killed after 30 s) and its log closed."""
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()


def stream_completion(port: int, body: dict, disconnect_after: int | None = None, api_key: str | None = None) -> Result:
    """One streamed completion; ``disconnect_after``: hang up after that many tokens."""
    result = Result(max_tokens=body.get("max_tokens", 16))
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"{resp.status} {resp.read()[:200]!r}"
            return result
        last = None
        for event in sse_events(resp):
            if "error" in event:
                result.error = event["error"].get("message")
                break
            for choice in event.get("choices", []):
                if choice.get("text") or (choice.get("finish_reason") is None):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - start
                    elif last is not None:
                        result.gaps.append(now - last)
                    last = now
                    result.tokens += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            if event.get("usage"):
                usage = event["usage"]
                result.tokens = usage["completion_tokens"]
                result.prompt_tokens = usage.get("prompt_tokens")
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if disconnect_after is not None and result.tokens >= disconnect_after:
                result.disconnected = True
                conn.sock.shutdown(socket.SHUT_RDWR)
                break
        result.ok = result.error is None and (result.disconnected or result.finish_reason is not None)
    except (OSError, http.client.HTTPException) as err:
        result.error = f"{type(err).__name__}: {err}"
    finally:
        result.seconds = time.perf_counter() - start
        conn.close()
    return result


def run_clients(port: int, bodies: list[dict], clients: int, disconnect: dict | None = None, api_key: str | None = None) -> tuple:
    """Send ``bodies`` through ``clients`` concurrent clients (each takes the next body when done);
    ``disconnect``: body index -> tokens after which that request hangs up. (results, wall seconds)."""
    results: list[Result | None] = [None] * len(bodies)
    next_index = iter(range(len(bodies)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = stream_completion(port, bodies[i], (disconnect or {}).get(i), api_key)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1): the least value with at least ``q`` of them at or
    below it; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(results: list[Result], wall: float) -> dict:
    """A row of requests that ran together: tokens/s over the wall time, counting the tokens each finished
    request generated (its usage where the server reports it, else its streamed chunks); the latencies'
    p50 and p95; ``errors``: requests that did not finish (a hang-up asked for is neither)."""
    done = [r for r in results if r.ok and not r.disconnected]
    ttft = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    tokens = sum(r.tokens for r in done)
    prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
    return {"requests": len(done), "errors": sum(1 for r in results if not r.ok), "tokens": tokens,
            "tok_s": tokens / wall, "req_s": len(done) / wall, "ttft_p50": percentile(ttft, 0.5),
            "ttft_p95": percentile(ttft, 0.95), "itl_p50": percentile(gaps, 0.5), "itl_p95": percentile(gaps, 0.95),
            "itl_median": statistics.median(gaps) if gaps else float("nan"),
            "tokens_per_request": tokens / len(done) if done else float("nan"),
            "prompt_tokens": statistics.mean(prompts) if prompts else None,
            "cached_tokens": sum(r.cached_tokens for r in done)}


def wait_ready(port: int, path: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server did not answer {path} in {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (the server and its engine process), in MB; the
    children of every thread count, since a thread other than the main one may have started a child."""
    total = 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        children = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children |= {int(c) for c in f.read().split()}
    except OSError:  # it ended meanwhile
        return total
    return total + sum(rss_mb(child) for child in children)
