"""The OpenAI API's requests as pydantic models, its error object, and its responses (``Render``).

What the server does not do is refused, never ignored: an unknown field is a 400 naming it (the
models forbid extra fields), and the known ones it does not implement (``n > 1``, ``tools``,
``response_format``, penalties, ``logit_bias``, ``echo``, ``suffix``, ``best_of > 1``) are a 400
naming the field (``unsupported``)."""

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An OpenAI-style error: HTTP ``status``, ``message``, ``type``, the ``param`` at fault, a ``code``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart | ImagePart]
    name: str | None = None


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # an extension (vLLM and llama.cpp take it too); 0: no limit
    ignore_eos: bool = False  # an extension (vLLM and llama.cpp take it too): generate max_tokens past EOS
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None  # an end-user identifier; the server records nothing about it

    def unsupported(self) -> list[str]:
        """The fields set to something the server does not implement."""
        bad = []
        if self.n != 1:
            bad.append(f"n={self.n} (one choice per request)")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                bad.append(f"{name}={getattr(self, name)}")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"stop has {len(stops)} strings; at most 4 are allowed", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        return stops


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list | None = None
    tool_choice: object = None
    functions: list | None = None
    function_call: object = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        for name in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format"):
            if getattr(self, name) is not None:
                bad.append(name)
        if self.top_logprobs is not None and not self.logprobs:
            bad.append("top_logprobs without logprobs: true")
        return bad


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.suffix is not None:
            bad.append("suffix")
        if self.best_of not in (None, 1):
            bad.append(f"best_of={self.best_of}")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) > 1:
            bad.append(f"a batch of {len(self.prompt)} prompts (one prompt per request)")
        return bad


class Render:
    """OpenAI's response shapes, for chat (``chat.completion``) and completions (``text_completion``)."""

    def __init__(self, model: str, tokenizer, chat: bool):
        self.model, self.tokenizer, self.chat = model, tokenizer, chat
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset

    def _head(self, rid: str, obj: str) -> dict:
        return {"id": rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, tokens: list) -> dict | None:
        if not tokens or tokens[0].logprob is None:
            return None
        decode = self.tokenizer.decode
        if self.chat:
            def entry(token_id, logprob):
                text = decode([token_id])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [entry(t.id, t.logprob) | {"top_logprobs": [entry(i, lp) for i, lp in t.top]} for t in tokens]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text = decode([t.id])
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({decode([i]): lp for i, lp in t.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def start(self, rid: str) -> list[dict]:
        if not self.chat:
            return []
        return [self._head(rid, "chat.completion.chunk") | {
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}]

    def chunk(self, rid: str, event, finish_reason: str | None) -> dict:
        logprobs = self._logprobs(event.tokens)
        if self.chat:
            delta = {"content": event.text} if event.text or finish_reason is None else {}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._head(rid, "chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": event.text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._head(rid, "text_completion") | {"choices": [choice]}

    def usage_chunk(self, rid: str, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._head(rid, obj) | {"choices": [], "usage": usage}

    def whole(self, rid: str, text: str, tokens: list, finish_reason: str, usage: dict) -> dict:
        logprobs = self._logprobs(tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            return self._head(rid, "chat.completion") | {"choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._head(rid, "text_completion") | {"choices": [choice], "usage": usage}
