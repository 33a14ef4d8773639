"""A bounded soak of the server: 200 streamed requests from 16 concurrent clients, random prompt and
output lengths, 10% of them hanging up mid-stream. Checks that every other request ends with the
right ``finish_reason`` (``length`` exactly at its ``max_tokens``, or ``stop`` before it), that the
server holds no sequence and no queue at the end, and reports its resident memory over the run.

    python bench/serve_soak.py [--artifact DIR] [--requests 200 --clients 16]

Without ``--artifact`` it builds ``model=tiny_chat kv.max_seqs=8`` (seconds). Writes the section
"serve_soak" of docs/benchmarks.md. Exit status 1 when a check fails."""

import argparse
import random
import subprocess
import sys
import threading
import time

from _load import free_port, rss_mb, run_clients, summarize, wait_ready
from _results import REPO, write_section

WORDS = "the of and to in is was for on that with as by at from his her an were are which this be".split()


def metric(port: int, name: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    raise KeyError(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default=None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--disconnect", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    artifact = args.artifact
    if artifact is None:
        out = subprocess.run([sys.executable, "-m", "pipeline", "model=tiny_chat", "kv.max_seqs=8", "kv.capacity=512",
                              "kv.max_step_tokens=64", "experiment_name=soak"], cwd=REPO, capture_output=True, text=True)
        if out.returncode:
            print(out.stdout[-2000:], out.stderr[-2000:])
            return 1
        artifact = next(line.split()[1 if line.startswith("built ") else 3] for line in out.stdout.splitlines()
                        if line.startswith(("built ", "up to date: ")))
        artifact = str(REPO / artifact)
    rng = random.Random(args.seed)
    bodies, disconnect = [], {}
    for i in range(args.requests):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 300)))
        bodies.append({"model": "soak", "prompt": prompt, "max_tokens": rng.randint(4, 160), "temperature": rng.choice([0, 0.8]),
                       "seed": i, "stream_options": {"include_usage": True}})
        if rng.random() < args.disconnect:
            disconnect[i] = rng.randint(1, 3)
    port = free_port()
    log = open(REPO / "outputs" / "serve_soak.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "pipeline.serve", artifact, "--port", str(port), "--model-name", "soak",
                               "--max-queue", str(args.requests)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    failures = []
    try:
        wait_ready(port, "/ready", server)
        rss = [("ready", rss_mb(server.pid))]
        samples, stop = [], threading.Event()

        def sample():
            while not stop.wait(1.0):
                samples.append(rss_mb(server.pid))

        sampler = threading.Thread(target=sample)
        sampler.start()
        half = args.requests // 2
        first, wall1 = run_clients(port, bodies[:half], args.clients, disconnect)
        rss.append(("after the first half", rss_mb(server.pid)))
        second, wall2 = run_clients(port, bodies[half:], args.clients, {i - half: n for i, n in disconnect.items() if i >= half})
        rss.append(("after the second half", rss_mb(server.pid)))
        stop.set()
        sampler.join()
        results = first + second
        time.sleep(0.5)  # the engine's next iteration releases the last hung-up sequences
        live, queue = metric(port, "pipeline_live_sequences"), metric(port, "pipeline_queue_depth")
        cancelled = metric(port, 'pipeline_requests_total{outcome="cancelled"}')
        for i, (body, r) in enumerate(zip(bodies, results, strict=True)):
            if i in disconnect:
                if not r.disconnected and r.finish_reason is None:
                    failures.append(f"request {i}: meant to hang up, ended {r.error}")
                continue
            if not r.ok:
                failures.append(f"request {i}: {r.error}")
            elif r.finish_reason == "length" and r.tokens != body["max_tokens"]:
                failures.append(f"request {i}: finish_reason length after {r.tokens} of max_tokens={body['max_tokens']}")
            elif r.finish_reason == "stop" and r.tokens > body["max_tokens"]:
                failures.append(f"request {i}: finish_reason stop after {r.tokens} tokens, past max_tokens={body['max_tokens']}")
            elif r.finish_reason not in ("stop", "length"):
                failures.append(f"request {i}: finish_reason {r.finish_reason}")
        if live or queue:
            failures.append(f"at the end: {live:.0f} live sequences, {queue:.0f} queued")
        summary = summarize(results, wall1 + wall2)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    hung_up = sum(1 for r in results if r.disconnected)
    lines = [
        "## Server soak: 200 streamed requests, 16 clients, 10% hanging up (tiny_chat, kv.max_seqs=8, CPU)",
        "",
        f"`python bench/serve_soak.py` ({time.strftime('%Y-%m-%d')}): random prompts of 5-300 words and max_tokens 4-160, "
        "greedy or sampled at 0.8; each hung-up request closes its connection after 1-3 tokens.",
        "",
        "| requests | hung up | completed | errors | cancelled (server's count) | live / queued at the end | tokens | wall s | tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {len(results)} | {hung_up} | {summary['requests']} | {len(failures)} | {cancelled:.0f} | {live:.0f} / {queue:.0f} | "
        f"{summary['tokens']} | {wall1 + wall2:.1f} | {summary['tok_s']:.0f} |",
        "",
        "| resident memory of the server (its process and the engine's) | MB |",
        "|---|---|",
        *[f"| {when} | {mb:.0f} |" for when, mb in rss],
        f"| max over the run (sampled each second) | {max(samples or [float('nan')]):.0f} |",
        "",
        "Checks: every request that did not hang up ended with finish_reason `length` exactly at its max_tokens or "
        f"`stop` before it; no live sequence and no queue at the end. Result: {'PASSED' if not failures else 'FAILED'}.",
    ]
    print("\n".join(lines))
    for failure in failures[:20]:
        print("  FAILED:", failure)
    if not args.no_write:
        write_section("serve_soak", "\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
