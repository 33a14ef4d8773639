"""Inter-token latency of running streams while a long prompt arrives: the chunked-prefill policy
measured. Four greedy streams decode; after they are running, a request with a ``--long``-token
prompt arrives. Reports the streams' gaps between tokens before it and while it is prefilled (from
its arrival to its first token), and its time to first token.

    python bench/serve_prefill.py --artifact outputs/smollm2_int4_long/v0001 [--long 1000]

The policy (``pipeline/runtime/schedule.py``): every step feeds one token of each decoding stream, and the
prompt takes the rest of the step's ``kv.max_step_tokens`` (at most ``--prefill-chunk`` while others decode). Writes the "serve_prefill" section of
docs/benchmarks.md."""

import argparse
import shlex
import subprocess
import sys
import threading
import time

from _load import free_port, stream_completion, wait_ready
from _results import REPO, write_section


def _pct(xs: list, which: int = 3) -> str:
    if not xs:
        return "-"
    values = [xs[len(xs) // 2], xs[int(0.95 * (len(xs) - 1))], xs[-1]]
    values = values if which == 3 else [values[0], values[2]]
    return " / ".join(f"{v * 1000:.1f}" for v in values)


def measure(args, chunk: int, long_prompt: str, max_tokens: int) -> tuple:
    """(long prompt's TTFT, sorted gaps before, sorted gaps while prefilled, sorted /health latencies)."""
    port = free_port()
    log = open(REPO / "outputs" / "serve_prefill.log", "w")
    extra = ["--prefill-chunk", str(chunk)] if chunk else []
    server = subprocess.Popen([sys.executable, "-m", "pipeline.serve", args.artifact, "--port", str(port), "--model-name", "m",
                               *extra], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    stamps: dict[int, list[float]] = {i: [] for i in range(args.streams)}
    try:
        wait_ready(port, "/ready", server)
        stream_completion(port, {"model": "m", "prompt": "warm up", "max_tokens": 4, "temperature": 0})

        def run(i):
            import http.client
            import json

            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": f"Story {i}: once upon a time",
                                                                "max_tokens": max_tokens, "temperature": 0, "stream": True}),
                         {"Content-Type": "application/json"})
            for raw in conn.getresponse():
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps[i].append(time.perf_counter())
            conn.close()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.streams)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps.values()) < 20:
            time.sleep(0.01)
        health, polling = [], threading.Event()

        def poll():  # /health's latency while the long prompt is prefilled
            import urllib.request

            while not polling.is_set():
                t0 = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
                    r.read()
                health.append((t0, time.perf_counter() - t0))
                time.sleep(0.02)

        poller = threading.Thread(target=poll)
        arrival = time.perf_counter()
        poller.start()
        long = stream_completion(port, {"model": "m", "prompt": long_prompt, "max_tokens": 1, "temperature": 0})
        first = arrival + long.ttft
        polling.set()
        poller.join()
        for t in threads:
            t.join()
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()

    def gaps(lo, hi):
        out = []
        for s in stamps.values():
            out += [b - a for a, b in zip(s, s[1:], strict=False) if lo <= a and b <= hi]
        return sorted(out)

    return long.ttft, gaps(arrival - 3.0, arrival), gaps(arrival, first), sorted(latency for t0, latency in health if t0 < first)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--long", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prefill-chunks", type=int, nargs="+", default=[0, 16],
                        help="the server's --prefill-chunk for each run (0: its default, the whole width left)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from pipeline.runtime.session import Session

    session = Session(args.artifact)
    tok = session.tokenizer
    ids = tok(" ".join(["lighthouse keeper story"] * args.long)).input_ids[: args.long]
    long_prompt = tok.decode(ids)
    n_long = len(tok(long_prompt).input_ids)
    max_tokens = min(400, session.max_length - 40 if session.max_length else 400)
    del session
    rows = []
    for chunk in args.prefill_chunks:
        rows.append(measure(args, chunk, long_prompt, max_tokens))
    lines = [f"## Inter-token latency while a {n_long}-token prompt arrives ({args.streams} streams, CPU)", "",
             f"`python bench/serve_prefill.py {shlex.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}): {args.streams} greedy "
             f"streams decode; a {n_long}-token prompt arrives and is prefilled in the width each step leaves "
             "(kv.max_step_tokens less one token per stream), or at most `--prefill-chunk` tokens a step. Gaps between "
             "the streams' tokens in the 3 s before it and while it is prefilled (its arrival to its first token), and "
             "/health's latency meanwhile (the engine runs in its own process).", "",
             "| --prefill-chunk | long prompt's TTFT ms | gaps before: p50 / p95 / max ms | gaps while prefilled: p50 / p95 / max ms "
             "| /health calls, p50 / max ms |", "|---|---|---|---|---|"]
    for chunk, (ttft, before, during, seen) in zip(args.prefill_chunks, rows, strict=True):
        lines.append(f"| {chunk or 'default'} | {ttft * 1000:.0f} | {_pct(before)} | {_pct(during)} | "
                     f"{len(seen)}, {_pct(seen, 2)} |")
    print("\n".join(lines))
    if not args.no_write:
        write_section("serve_prefill", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
