# ruff: noqa: F811  (the fixtures imported from server_fixtures are parameters of the tests)
"""The server against the ``Session`` it drives, through the ``openai`` client and plain HTTP, on a
real server process: text, streaming, concurrency, seeds, logprobs, stop strings, cancellation, the
queue limit, timeouts, bad requests, and liveness while a long prompt is prefilled; and the app over an
in-process ``Engine`` whose thread dies or hangs: no request waits forever."""

import base64
import concurrent.futures
import io
import threading
import time

import pytest
import torch

from server_fixtures import (  # noqa: F401  (fixtures)
    API_KEY,
    Stream,
    app_server,
    chat_artifact,
    draft_server,
    draft_vision_artifact,
    request,
    running_server,
    server,
    stream_events,
)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]


def session_greedy(artifact, prompt_ids: list[int], n: int, image=None) -> list[int]:
    """The oracle: the artifact's ``Session`` alone, chunked prefill then greedy decode steps."""
    from pipeline.runtime.session import Session

    session = Session(artifact)
    session.add("s")
    if image is not None:
        session.add_image("s", image)
    for start in range(0, len(prompt_ids), session.max_step_tokens):
        logits = session.step({"s": prompt_ids[start: start + session.max_step_tokens]})["s"]
    out = []
    while len(out) < n:
        out.append(int(logits.argmax()))
        if out[-1] == session.tokenizer.eos_token_id:
            break
        logits = session.step({"s": [out[-1]]})["s"]
    return out


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_health_ready_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.get("/health") == (200, {"status": "ok"})
    status, ready = server.get("/ready")
    assert status == 200 and ready["status"] == "ready"
    for name in ("pipeline_queue_depth", "pipeline_live_sequences", 'pipeline_requests_total{outcome="stop"}'):
        server.metric(name)
    status, body = request(server.port, "GET", "/v1/models")  # no key
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_greedy_completion_is_the_sessions(server, client, chat_artifact):
    from pipeline.runtime.session import Session

    tokenizer = Session(chat_artifact).tokenizer
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0)
    want = session_greedy(chat_artifact, tokenizer(PROMPTS[0]).input_ids, 24)
    assert out.choices[0].text == tokenizer.decode([t for t in want if t != tokenizer.eos_token_id], skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(tokenizer(PROMPTS[0]).input_ids)
    assert out.usage.completion_tokens == len(want)
    assert out.choices[0].finish_reason == ("stop" if want[-1] == tokenizer.eos_token_id else "length")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_text_equals_the_whole_text(server, client, chat):
    kwargs = dict(model="tiny", max_tokens=20, temperature=0.9, seed=11)
    if chat:
        whole = client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}], **kwargs)
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}], stream=True,
                                                     stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content and text
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        whole = client.completions.create(prompt=PROMPTS[1], **kwargs)
        chunks = list(client.completions.create(prompt=PROMPTS[1], stream=True, stream_options={"include_usage": True},
                                                **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole.choices[0].text and text
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_repeated_prompt_reports_its_cached_tokens_whole_and_streamed(server, client, chat):
    """A prompt sent again adopts the rows the first request left: all its tokens but the last are
    ``usage.prompt_tokens_details.cached_tokens``, in a whole response and in a stream's usage chunk, and
    the text is the same; /metrics counts them."""
    reused_before = server.metric("pipeline_prefix_cache_reused_tokens_total")
    content = f"Tell me about prefix number {int(chat)}: " + "the quick brown fox jumps over the lazy dog " * 6
    kwargs = dict(model="tiny", max_tokens=6, temperature=0)
    if chat:
        messages = [{"role": "user", "content": content}]
        first, second = (client.chat.completions.create(messages=messages, **kwargs) for _ in range(2))
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, **kwargs))
        text = [first.choices[0].message.content, second.choices[0].message.content,
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)]
    else:
        first, second = (client.completions.create(prompt=content, **kwargs) for _ in range(2))
        chunks = list(client.completions.create(prompt=content, stream=True, stream_options={"include_usage": True},
                                                **kwargs))
        text = [first.choices[0].text, second.choices[0].text, "".join(c.choices[0].text for c in chunks if c.choices)]
    assert text[0] == text[1] == text[2] and text[0]
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < n - 1  # nothing held all of it yet
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == n - 1
    assert server.metric("pipeline_prefix_cache_reused_tokens_total") >= reused_before + 2 * (n - 1)


def test_a_chat_through_a_server_without_the_prefix_cache_has_the_same_text(server, client, chat_artifact, tmp_path):
    """Three greedy turns of a chat, each with the whole conversation, against a server started with
    --no-prefix-cache: the same replies; only the server with the cache reports cached tokens."""
    from openai import OpenAI

    def chat(c) -> tuple[list[str], list[int]]:
        messages, replies, cached = [], [], []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Turn {turn}: tell me more about rivers and the sea."})
            out = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            replies.append(out.choices[0].message.content)
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": replies[-1]})
        return replies, cached

    replies, cached = chat(client)
    with running_server(chat_artifact, tmp_path, "--no-prefix-cache") as off:
        replies_off, cached_off = chat(OpenAI(base_url=off.url + "/v1", api_key=API_KEY, max_retries=0))
        assert off.metric("pipeline_prefix_cache_queried_tokens_total") == 0
    assert replies == replies_off
    assert cached_off == [0, 0, 0] and all(n > 0 for n in cached[1:])


def test_concurrent_greedy_requests_each_get_their_text_alone(server, client):
    def one(prompt):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0).choices[0].text

    alone = [one(p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, PROMPTS))
    assert together == alone
    assert len(set(alone)) == 4


def test_a_seed_gives_the_same_text_alone_and_among_others(server, client):
    def one(prompt, seed):
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=1.0, top_p=0.95,
                                         seed=seed).choices[0].text

    alone = one(PROMPTS[2], 5)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(one, p, s) for p, s in zip(PROMPTS, (1, 2, 3, 4), strict=True)]
        together = pool.submit(one, PROMPTS[2], 5).result()
        [f.result() for f in crowd]
    assert together == alone
    assert one(PROMPTS[2], 6) != alone  # the seed matters


def test_logprobs_are_the_models(server, client, chat_artifact):
    from pipeline.runtime.session import Session

    out = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) == 2 for t in lp.top_logprobs)
    session = Session(chat_artifact)
    session.add("s")
    logits = session.step({"s": session.tokenizer(PROMPTS[3]).input_ids})["s"]
    want = torch.log_softmax(logits.double(), -1)
    assert lp.token_logprobs[0] == pytest.approx(float(want.max()), abs=1e-4)  # greedy: the most likely token's
    assert max(lp.top_logprobs[0].values()) == pytest.approx(float(want.max()), abs=1e-4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 3


def test_stop_strings_end_the_text_before_them(server, client):
    base = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    cut = base.index(stop)
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop, "\x01never"])
    assert out.choices[0].text == base[:cut] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=stop, stream=True))
    assert streamed == base[:cut]


def test_a_cancelled_stream_frees_its_sequence(server):
    cancelled = server.metric('pipeline_requests_total{outcome="cancelled"}')
    events = stream_events(server.port, {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0},
                           stop_after=3)
    assert len(events) == 3
    deadline = time.monotonic() + 30
    while server.metric('pipeline_requests_total{outcome="cancelled"}') == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric('pipeline_requests_total{outcome="cancelled"}') == cancelled + 1
    assert server.metric("pipeline_live_sequences") == 0


BAD = [
    (b'{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ({"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature", "greater than or equal"),
    ({"model": "gpt-9", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"model": "tiny", "prompt": "hello " * 1400}, 400, "prompt", "context is 1280 tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 5000}, 400, "prompt", "asks for 5000 more"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt", "empty"),
    ({"model": "tiny", "prompt": "hi", "n": 2}, 400, "n", "unsupported parameters: n=2"),
    ({"model": "tiny", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "not a parameter"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools",
     "unsupported parameters: tools"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}}, 400,
     "response_format", "unsupported"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}]}]}, 400, "messages[0].content", "no vision encoder"),
]


@pytest.mark.parametrize("body, status, param, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_bad_request_gets_its_error_and_the_server_serves_the_next(server, client, body, status, param, message):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    got, error = server.post(path, body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert message in error["error"]["message"] and error["error"]["param"] == param
    if "context" in message or "asks for" in message:
        assert error["error"]["code"] == "context_length_exceeded"
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2, temperature=0).choices[0].text


def test_health_answers_while_a_long_prompt_is_prefilled(server, client):
    """A 1,000-token prompt is prefilled in chunks of the step width; /health never waits for it."""
    long_prompt = " ".join(["word"] * 1000)
    done = threading.Event()
    result = {}

    def long_request():
        result["out"] = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=4, temperature=0)
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    latencies, during = [], 0
    while not done.is_set():
        start = time.perf_counter()
        assert server.get("/health")[0] == 200
        latencies.append(time.perf_counter() - start)
        during += server.metric("pipeline_live_sequences") > 0
    thread.join()
    assert result["out"].usage.prompt_tokens >= 1000 and during > 0
    assert max(latencies) < 0.1, f"/health took {max(latencies) * 1000:.0f} ms"


def test_the_queue_limit_refuses_and_timeouts_end_requests_cleanly(chat_artifact, tmp_path):
    with running_server(chat_artifact, tmp_path, "--max-queue", "1", "--request-timeout", "2") as s:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1200, "temperature": 0, "stream": True}
        results = {}

        def run(i):
            results[i] = stream_events(s.port, body)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while (s.metric("pipeline_live_sequences") < 4 or s.metric("pipeline_queue_depth") < 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.metric("pipeline_live_sequences") == 4 and s.metric("pipeline_queue_depth") == 1
        status, error = s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 503 and error["error"]["code"] == "overloaded"
        for t in threads:
            t.join()
        ends = [results[i][-2] for i in range(5)]  # the last payload before [DONE]
        assert all(r[-1] == "[DONE]" for r in results.values())
        assert [e.get("error", {}).get("code") for e in ends].count("timeout") >= 4, ends
        assert s.metric("pipeline_live_sequences") == 0 and s.metric("pipeline_queue_depth") == 0
        assert s.metric('pipeline_requests_total{outcome="rejected"}') == 1
        assert s.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0] == 200


# --- the app over an in-process Engine (as the tests and bench/serve.py's "engine alone" drive it) ---

ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def in_process(chat_artifact):
    from pipeline.runtime.session import Session
    from pipeline.serve.engine import Engine
    from pipeline.serve.metrics import Metrics

    engine = Engine(Session(chat_artifact), Metrics())
    engine.start()
    yield engine
    engine.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's planted death
def test_a_dead_engine_thread_leaves_no_request_waiting_and_the_next_is_refused(in_process, chat_artifact):
    """The engine thread dies in a step and its own clean-up fails too (the session cannot release the
    sequences): it told no request. The app ends each with an error, and refuses the next with 503."""
    from pipeline.serve.app import Settings

    session = in_process.session
    real_step = session.step

    def step(feeds):
        if len(feeds) >= 2:  # the stream and the whole request share this step
            raise RuntimeError("a planted failure that kills the engine thread")
        return real_step(feeds)

    def release(seq_id):
        raise RuntimeError("a planted failure of the clean-up")

    session.step, session.release = step, release
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0}
    with app_server(in_process, chat_artifact, Settings("tiny")) as port:
        stream = Stream(port, body, timeout=30)
        stream.read(1)  # generating
        status, error = request(port, "POST", "/v1/completions", {**body, "max_tokens": 8}, timeout=30)
        assert status == 500 and set(error["error"]) == ERROR_KEYS and error["error"]["code"] == "engine_failed", error
        assert "a planted failure that kills the engine thread" in error["error"]["message"]
        events = stream.read()
        stream.close()
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_failed", events[-2:]
        assert not in_process.alive
        status, error = request(port, "POST", "/v1/completions", body, timeout=30)
        assert status == 503 and set(error["error"]) == ERROR_KEYS and error["error"]["code"] == "engine_unavailable", error
        status, health = request(port, "GET", "/health")
        assert status == 503 and "planted" in health["error"]
        status, ready = request(port, "GET", "/ready")
        assert status == 503 and "planted" in ready["error"]


def test_an_engine_that_does_not_answer_in_time_ends_whole_and_streamed_requests_with_504(in_process, chat_artifact):
    """The engine is stuck in a step (it cannot check deadlines): past its --request-timeout and the
    grace the app gives the engine, each request ends with 504 ``engine_timeout``."""
    from pipeline.serve.app import Settings

    session = in_process.session
    real_step, gate = session.step, threading.Event()

    def stuck(feeds):
        gate.wait(60)
        return real_step(feeds)

    session.step = stuck
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    try:
        with app_server(in_process, chat_artifact, Settings("tiny", request_timeout=0.5, engine_grace=0.5)) as port:
            status, error = request(port, "POST", "/v1/completions", body, timeout=30)
            assert status == 504 and set(error["error"]) == ERROR_KEYS and error["error"]["code"] == "engine_timeout", error
            assert "--request-timeout of 0.5 s" in error["error"]["message"]
            stream = Stream(port, body, timeout=30)
            events = stream.read()
            stream.close()
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_timeout", events
    finally:
        gate.set()


# --- a draft and a vision encoder ---


@pytest.fixture(scope="module")
def draft_client(draft_server):
    from openai import OpenAI

    return OpenAI(base_url=draft_server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_greedy_speculative_output_is_greedy_output_without_the_draft(draft_server, draft_client, draft_vision_artifact):
    from pipeline.runtime.session import Session

    tokenizer = Session(draft_vision_artifact).tokenizer
    for prompt in PROMPTS[:2]:
        out = draft_client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0)
        want = session_greedy(draft_vision_artifact, tokenizer(prompt).input_ids, 40)
        assert out.choices[0].text == tokenizer.decode([t for t in want if t != tokenizer.eos_token_id],
                                                       skip_special_tokens=True)
        spec = out.model_extra["usage"]["speculative"] if "usage" in out.model_extra else out.usage.model_extra["speculative"]
        assert spec["rounds"] >= 1 and spec["proposed"] >= spec["accepted"] >= 0
    assert draft_server.metric("pipeline_speculative_proposed_tokens_total") > 0


def test_sampled_speculative_output_depends_on_its_seed(draft_client):
    def one(seed):
        return draft_client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=30, temperature=0.8,
                                               seed=seed).choices[0].text

    assert one(3) == one(3) != one(4)


def _png(width: int, height: int, seed: int) -> str:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_in_a_chat_is_what_the_session_sees(draft_server, draft_client, draft_vision_artifact):
    from PIL import Image

    from pipeline.runtime.session import Session

    url = _png(32, 32, 0)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    out = draft_client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    session = Session(draft_vision_artifact)
    tok, vision = session.tokenizer, session.vision
    text = tok.apply_chat_template([{"role": "user", "content": "What is this? \x00"}], tokenize=False,
                                   add_generation_prompt=True)
    before, after = text.split("\x00")
    ids = (tok(before, add_special_tokens=False).input_ids + [vision["image_token_id"]] * vision["n_image_tokens"]
           + tok(after, add_special_tokens=False).input_ids)
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",")[1]))).convert("RGB")
    want = session_greedy(draft_vision_artifact, ids, 12, image=image)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.content == tok.decode([t for t in want if t != tok.eos_token_id], skip_special_tokens=True)
    other = draft_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is this? "}, {"type": "image_url", "image_url": {"url": _png(32, 32, 1)}}]}],
        max_tokens=12, temperature=0)
    assert other.choices[0].message.content != out.choices[0].message.content  # the image is read
    big = draft_client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png(100, 60, 2)}}]}], max_tokens=2, temperature=0)
    assert big.usage.completion_tokens == 2  # a larger image is scaled down to the exported size


@pytest.mark.parametrize("url, message", [("https://example.com/cat.png", "remote image URLs are not fetched"),
                                          ("data:image/png;base64,!!!", "could not be decoded"),
                                          ("data:text/plain;base64,aGk=", "data:image/")])
def test_a_bad_image_is_refused(draft_server, url, message):
    status, error = draft_server.post("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]})
    assert status == 400 and message in error["error"]["message"]


@pytest.mark.slow
def test_smollm2_is_served_and_answers(build_dir, tmp_path):
    """The real model through the server: SmolLM2-135M-Instruct's own blocks, its chat template."""
    artifact = build_dir("model=smollm2_135m", "quant=from_checkpoint", "kv.max_seqs=2", "kv.capacity=256",
                         "kv.max_step_tokens=64", "experiment_name=smollm2_serve")
    from openai import OpenAI

    with running_server(artifact, tmp_path) as s:
        client = OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
        text = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=8, temperature=0)
        assert "Paris" in text.choices[0].text
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                              max_tokens=24, temperature=0)
        assert "Paris" in chat.choices[0].message.content
