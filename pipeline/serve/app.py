"""The HTTP side: a FastAPI app over an ``Engine`` (in-process) or an ``EngineProcess`` (the server's).
It validates and tokenizes requests (in a worker thread, off the event loop), queues them, and turns
the engine's events into OpenAI responses or server-sent events. No model step ever runs on the event loop, nor in its process: ``/health``
answers while the engine prefills a long prompt.

While the engine is down (its process restarting, or the in-process engine's thread dead) a request is
refused with 503 ``engine_unavailable`` and ``/health`` and ``/ready`` answer 503 with the reason. A
request waiting for events never outlives the engine: every poll interval it checks that the engine is
alive, and past its ``--request-timeout`` (and ``engine_grace`` more, for the engine to end it itself)
it ends with 504 ``engine_timeout``, streamed or not."""

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pipeline.errors import SessionError
from pipeline.runtime.sampling import SamplingParams
from pipeline.serve import request as generation
from pipeline.serve.engine import Overloaded
from pipeline.serve.protocol import APIError, ChatRequest, CompletionRequest, Render

log = logging.getLogger("pipeline.serve")
RETRY_AFTER_S = 1  # what a refused client is told to wait: a sequence frees within a few decode steps
DOWN_RETRY_AFTER_S = 5  # ... while the engine is down: a restarted engine process loads the artifact for seconds
POLL_S = 0.25  # how often a waiting request checks its client, the engine and its deadline


@dataclass
class Settings:
    model_name: str
    api_key: str | None = None
    request_timeout: float | None = None  # seconds from arrival; None: none
    default_max_tokens: int = 512  # a chat without max_tokens on an artifact of unbounded context
    # seconds past a request's deadline that the app waits for the engine to end it (it checks deadlines
    # once per iteration, and an iteration is at most a long prefill chunk) before it answers 504 itself
    engine_grace: float = 5.0


def create_app(engine, prompts, settings: Settings) -> FastAPI:
    app = FastAPI(title="pipeline.serve", docs_url=None, redoc_url=None)
    tokenizer = prompts.tokenizer

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        log.warning("%s %s -> %d %s", request.method, request.url.path, err.status, err.message)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])} at character {loc[-1]})"
            param = None
        elif first.get("type") == "extra_forbidden":
            message = f"{param} is not a parameter this server takes"
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        return await api_error(request, APIError(400, message, param=param))

    def authorize(request: Request) -> None:
        if settings.api_key and request.headers.get("authorization") != f"Bearer {settings.api_key}":
            raise APIError(401, "a valid API key is needed: Authorization: Bearer <key>", type="authentication_error",
                           code="invalid_api_key")

    def down() -> str:
        """Why the engine serves nothing now."""
        return str(engine.error or "the engine is not running")

    def unavailable(reason: str) -> APIError:
        return APIError(503, f"the engine is not running ({reason}); retry later", type="server_error",
                        code="engine_unavailable", headers={"Retry-After": str(DOWN_RETRY_AFTER_S)})

    @app.get("/health")
    async def health():
        if not engine.alive:  # the process answers, but nothing can be served
            return JSONResponse({"status": "unavailable", "error": down()}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if not engine.alive:
            return JSONResponse({"status": "not ready", "error": down()}, status_code=503)
        running, waiting = engine.status()
        return {"status": "ready", "live_sequences": running, "queue_depth": waiting}

    @app.get("/metrics")
    async def metrics():
        return Response(await run_in_threadpool(engine.render_metrics), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "pipeline",
                                             "max_model_len": engine.context_limit}]}

    def check_model(body) -> None:
        if body.model != settings.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")

    def prepare(body, ids: list[int], images: list, default_max: int | None) -> generation.Request:
        """Checks the request against the artifact and makes the engine's request (nothing queued yet)."""
        if bad := body.unsupported():
            raise APIError(400, f"unsupported parameters: {', '.join(bad)}", param=bad[0].split("=")[0])
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        limit = engine.context_limit
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max
        if max_tokens is None:
            max_tokens = limit - len(ids) if limit is not None else settings.default_max_tokens
        if limit is not None and len(ids) + max(max_tokens, 1) > limit:
            raise APIError(400, f"this model's context is {limit} tokens; the request has {len(ids)} prompt tokens and "
                                f"asks for {max_tokens} more", param="messages" if isinstance(body, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        try:
            params = SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)
        except SessionError as err:
            raise APIError(400, str(err)) from None
        logprobs = None
        if isinstance(body, ChatRequest):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            logprobs = body.logprobs
        deadline = time.monotonic() + settings.request_timeout if settings.request_timeout else None
        return generation.Request(ids, max_tokens, params, body.stops(), logprobs, images, deadline=deadline,
                                  ignore_eos=body.ignore_eos)

    async def run(http: Request, body, request: generation.Request, render):
        """Queue ``request``; answer with one JSON body or a stream of events (``render`` makes the chunks)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def emit(event: generation.Event) -> None:  # called from the engine's thread: never raises into it
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed (the server is shutting down): nobody waits for it
                log.debug("request %d: a %r event after the event loop closed", request.id, event.kind)

        request.emit = emit
        if not engine.alive:
            raise unavailable(down())
        try:
            engine.submit(request)
        except Overloaded as err:
            engine.count_rejected()
            raise APIError(503, f"the server is at capacity ({err}); retry later", type="server_error",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except SessionError as err:  # the engine went down since the check above
            raise unavailable(str(err)) from None
        give_up_at = request.deadline + settings.engine_grace if request.deadline is not None else None
        started = time.monotonic()
        rid = f"{'chatcmpl' if isinstance(body, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex[:24]}"

        def line(outcome: str) -> None:
            log.info("%s %s request %d: %s, %d prompt + %d generated tokens in %.3f s", http.method, http.url.path,
                     request.id, outcome, len(request.prompt), len(request.generated), time.monotonic() - started)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events():
                done = False
                try:
                    for chunk in render.start(rid):
                        yield _sse(chunk)
                    while True:
                        event = await next_event(queue, request, give_up_at)
                        if event is None:
                            continue
                        if event.kind == "tokens":
                            if event.text or (request.logprobs is not None and event.tokens):
                                yield _sse(render.chunk(rid, event, None))
                            continue
                        done = True
                        if event.kind == "error":
                            line(f"error {event.status} {event.message}")
                            yield _sse({"error": {"message": event.message, "type": "server_error", "param": None,
                                                  "code": event.code}})
                        else:
                            line(f"finish_reason {event.finish_reason}")
                            yield _sse(render.chunk(rid, generation.Event("tokens"), event.finish_reason))
                            if include_usage:
                                yield _sse(render.usage_chunk(rid, event.usage))
                        yield "data: [DONE]\n\n"
                        return
                finally:
                    if not done:  # the client went away (the task was cancelled) or the stream broke
                        engine.cancel(request)
                        line("cancelled by the client")

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        tokens, text = [], []
        try:
            while True:
                event = await next_event(queue, request, give_up_at)
                if event is None:
                    if await http.is_disconnected():
                        engine.cancel(request)
                        line("cancelled by the client")
                        return Response(status_code=499)
                    continue
                if event.kind == "tokens":
                    tokens += event.tokens
                    text.append(event.text)
                elif event.kind == "error":
                    line(f"error {event.status} {event.message}")
                    raise APIError(event.status, event.message, type="server_error", code=event.code)
                else:
                    line(f"finish_reason {event.finish_reason}")
                    return render.whole(rid, "".join(text), tokens, event.finish_reason, event.usage)
        except asyncio.CancelledError:
            engine.cancel(request)
            raise

    async def next_event(queue: asyncio.Queue, request: generation.Request, give_up_at: float | None):
        """The engine's next event for ``request``; None after ``POLL_S`` without one. An error event of the
        app's own when the engine died without ending the request (an in-process engine's thread can die
        and leave it in no list) or has not ended it by ``give_up_at`` (stuck in a step)."""
        try:
            return await asyncio.wait_for(queue.get(), timeout=POLL_S)
        except TimeoutError:
            pass
        if not queue.empty():
            return queue.get_nowait()
        if not engine.alive:
            return generation.Event("error", status=500, message=f"the engine stopped: {down()}", code="engine_failed")
        if give_up_at is not None and time.monotonic() > give_up_at:
            engine.cancel(request)
            return generation.Event("error", status=504, code="engine_timeout", message=(
                f"the engine did not answer within the server's --request-timeout of {request.deadline - request.arrived:.1f} s "
                f"(and {settings.engine_grace:g} s more)"))
        return None

    @app.post("/v1/chat/completions")
    async def chat(http: Request, body: ChatRequest):
        authorize(http)
        check_model(body)
        ids, images = await run_in_threadpool(prompts.chat, body)
        request = prepare(body, ids, images, None)
        return await run(http, body, request, Render(settings.model_name, tokenizer, chat=True))

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest):
        authorize(http)
        check_model(body)
        ids = await run_in_threadpool(prompts.completion, body)
        request = prepare(body, ids, [], 16)
        return await run(http, body, request, Render(settings.model_name, tokenizer, chat=False))

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
