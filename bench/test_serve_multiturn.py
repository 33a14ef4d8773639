"""The multi-turn benchmark's own checks (``bench/serve_multiturn.py``), without a server: the messages,
a chat's turns against a stand-in server (a conversation grows by each reply), the summary and its
tables, the arguments."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import serve_multiturn as bench


def test_messages_have_their_words_and_differ_between_chats_and_turns():
    messages = {(c, k): bench.user_message(c, k, 70) for c in range(4) for k in range(6)}
    assert len(set(messages.values())) == len(messages)
    for (c, k), text in messages.items():
        tag, words = text.split(": ", 1)
        assert tag == f"Chat {c}, turn {k}" and len(words.split()) == 70


class _Echo(BaseHTTPRequestHandler):
    """A chat server: streams ``reply N`` (N: the messages it was sent) in two deltas, then usage saying
    every prompt token but the last new message's came from its cache."""

    def do_POST(self):  # noqa: N802  (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        n = len(body["messages"])
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in ({"choices": [{"delta": {"content": "reply "}}]}, {"choices": [{"delta": {"content": str(n)}}]},
                      {"choices": [], "usage": {"prompt_tokens": 10 * n, "prompt_tokens_details": {"cached_tokens": 10 * (n - 1)}}}):
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(bench.GGUF.parent), gguf_file=bench.GGUF.name)


@pytest.fixture
def echo():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()


def test_each_turn_sends_the_whole_conversation_and_its_reply_is_kept(echo):
    chats, wall = bench.run_chats(echo.server_address[1], 2, 3, 5, 4, {})
    assert wall > 0 and len(echo.bodies) == 6
    for chat in chats:
        assert [t.text for t in chat.turns] == ["reply 1", "reply 3", "reply 5"]
        assert [(t.prompt_tokens, t.cached_tokens) for t in chat.turns] == [(10, 0), (30, 20), (50, 40)]
        assert all(t.error is None and 0 < t.ttft <= t.seconds for t in chat.turns)
    last = max(echo.bodies, key=lambda b: len(b["messages"]))
    assert [m["role"] for m in last["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert last["messages"][1]["content"] == "reply 1" and last["stream"] and last["temperature"] == 0
    assert last["ignore_eos"] and last["max_tokens"] == 4
    row = bench.summarize(chats, wall, 3)
    assert [t["prompt"] for t in row["turns"]] == [10, 30, 50] and row["errors"] == 0


def _row(ttfts, wall):
    return {"turns": [{"ttft": t, "prompt": 100 * (k + 1), "cached": 90 * k, "chats": 1} for k, t in enumerate(ttfts)],
            "wall": wall, "errors": 0, "first_error": None}


def test_tables_and_ratios():
    results = {"ours": {1: _row([0.2, 0.3, 0.6], 3.0)}, "llama-server": {1: _row([0.3, 0.3, 0.3], 2.0)}}
    lines = bench.table(results, 3)
    assert lines[0] == "| server | chats at once | turn 1 | turn 2 | turn 3 | whole run |"
    assert lines[2] == "| ours | 1 | 200 ms (100 tok, 0 cached) | 300 ms (200 tok, 90 cached) | 600 ms (300 tok, 180 cached) | 3.0 s |"
    assert bench.ratios(results, 3)[2] == "| ours | 1 | 2.00 | 1.50 | 2.00 | 1.00 |"
    assert bench.ratios({"ours": results["ours"]}, 3) == []


def test_arguments(tokenizer):
    quick = bench.parse_args(["--artifact", "a", "--quick"])
    assert (quick.chats, quick.turns, quick.reply_tokens) == ([1], 2, 8) and quick.out.parent.is_dir()
    quick.out.parent.rmdir()
    full = bench.parse_args(["--artifact", "a"])
    assert (full.chats, full.turns, full.user_words, full.reply_tokens) == ([1, 4], 6, 70, 48)
    need = bench.longest_conversation(full, tokenizer)
    assert 700 < need <= 1024, f"{need}: six turns fit llama-server's slot and a 1,024-token artifact"
    with pytest.raises(SystemExit):
        bench.parse_args(["--artifact", "a", "--turns", "0"])
