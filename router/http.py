"""OpenAI-compatible HTTP on the router's event loop (aiohttp): completions, chat completions, models, health, metrics.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take the OpenAI request bodies (one prompt, ``n = 1``)
plus the extensions ``top_k``, ``min_p``, ``ignore_eos``, ``speculation``, ``drafter``, ``num_draft_tokens``,
``tree_width`` and ``tree_budget``. With ``"stream": true`` the answer is server-sent events, one
``data: {chunk}`` per round that released text, the last chunk carrying ``finish_reason``, then
``data: [DONE]``; otherwise one JSON object with ``choices`` and ``usage``. Both carry the request's speculation
counters under ``"speculation"``. Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 naming the
field, 401 without the bearer token, 429 with ``Retry-After`` when overloaded, 503 without a verifier.
``GET /metrics`` is the Prometheus exposition of :class:`~router.metrics.RouterMetrics`; like ``/health`` (and
vLLM's ``/metrics``) it needs no bearer token.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.errors import (
    NoWorkerError,
    OverloadedError,
    UnauthenticatedError,
    WorkerRejectedError,
    WorkerUnavailableError,
)
from router.frontend import Frontend
from router.pipeline import Chunk, Final
from router.requests import GenerateInput, Message, Plan
from specdec.errors import CapacityError, InvalidArgumentError, SpecdecError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
MAX_BODY_BYTES = 4 * 1024 * 1024
FRONTEND_KEY = web.AppKey("frontend", Frontend)
_CREATED = int(time.time())

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_status(error: BaseException, retry_after_s: float) -> tuple[int, dict[str, Any], dict[str, str]]:
    """HTTP status, JSON body and headers for a failed request."""
    if isinstance(error, InvalidArgumentError):
        return 400, error_body(str(error), "invalid_request_error", error.field), {}
    if isinstance(error, WorkerRejectedError):
        field, _, _ = error.detail.partition(":")
        return 400, error_body(str(error), "invalid_request_error", field.strip() or None), {}
    if isinstance(error, CapacityError):
        seconds = error.retry_after_s if isinstance(error, OverloadedError) else retry_after_s
        return 429, error_body(str(error), "rate_limit_error"), {"Retry-After": str(max(1, math.ceil(seconds)))}
    if isinstance(error, UnauthenticatedError):
        return 401, error_body(str(error), "authentication_error"), {}
    if isinstance(error, WorkerUnavailableError | NoWorkerError):
        return 503, error_body(str(error), "service_unavailable"), {}
    return 500, error_body(f"internal error: {error}", "internal_error"), {}


def error_response(error: BaseException, retry_after_s: float) -> web.Response:
    status, body, headers = error_status(error, retry_after_s)
    return web.json_response(body, status=status, headers=headers)


# --- request bodies -------------------------------------------------------------------------------------------


def _typed(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """``body[name]`` checked against ``kind`` (number, integer, boolean, string); missing or null → default."""
    value = body.get(name)
    if value is None:
        return default
    valid = {
        "number": isinstance(value, int | float) and not isinstance(value, bool),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "string": isinstance(value, str),
    }[kind]
    if not valid:
        raise InvalidArgumentError(name, f"must be a {kind}, got {json.dumps(value)[:40]}")
    return float(value) if kind == "number" else value


def _token_ids(value: list[Any], name: str) -> tuple[int, ...]:
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in value):
        raise InvalidArgumentError(name, "a token list must hold integers only")
    return tuple(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(item, str) for item in stops):
        raise InvalidArgumentError("stop", "must be a string or a list of strings")
    return tuple(stops)


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """Fields shared by completions and chat completions."""
    if _typed(body, "n", "integer", 1) != 1:
        raise InvalidArgumentError("n", "only n = 1 is supported")
    return {
        "model": _typed(body, "model", "string", ""),
        "temperature": _typed(body, "temperature", "number"),
        "top_p": _typed(body, "top_p", "number"),
        "top_k": _typed(body, "top_k", "integer", 0),
        "min_p": _typed(body, "min_p", "number", 0.0),
        "seed": _typed(body, "seed", "integer"),
        "stop": _stop(body),
        "ignore_eos": _typed(body, "ignore_eos", "boolean", False),
        "speculation": _typed(body, "speculation", "string", ""),
        "drafter": _typed(body, "drafter", "string", ""),
        "num_draft_tokens": _typed(body, "num_draft_tokens", "integer", 0),
        "tree_width": _typed(body, "tree_width", "integer", 0),
        "tree_budget": _typed(body, "tree_budget", "integer", 0),
    }


def completion_input(body: dict[str, Any]) -> GenerateInput:
    """A ``/v1/completions`` body as a GenerateInput (one prompt: text or token ids)."""
    if _typed(body, "echo", "boolean", False):
        raise InvalidArgumentError("echo", "is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        text, ids = prompt, ()
    elif isinstance(prompt, list) and prompt and not all(isinstance(item, int) for item in prompt):
        raise InvalidArgumentError("prompt", "must be one string or one list of token ids (batches are not supported)")
    elif isinstance(prompt, list):
        text, ids = "", _token_ids(prompt, "prompt")
    else:
        raise InvalidArgumentError("prompt", "must be a string or a list of token ids")
    logprobs = _typed(body, "logprobs", "integer")
    return GenerateInput(
        prompt=text,
        prompt_ids=ids,
        max_tokens=_typed(body, "max_tokens", "integer", COMPLETIONS_DEFAULT_MAX_TOKENS),
        logprobs=logprobs is not None,
        **_common(body),
    )


def chat_input(body: dict[str, Any]) -> GenerateInput:
    """A ``/v1/chat/completions`` body as a GenerateInput (messages through the chat template)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of {role, content} objects")
    decoded = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgumentError(f"messages[{index}]", "must be an object with a string role")
        decoded.append(Message(message["role"], _content(message.get("content"), index)))
    max_tokens = _typed(body, "max_completion_tokens", "integer")
    return GenerateInput(
        messages=tuple(decoded),
        max_tokens=max_tokens if max_tokens is not None else _typed(body, "max_tokens", "integer"),
        logprobs=_typed(body, "logprobs", "boolean", False),
        **_common(body),
    )


def _content(content: Any, index: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    ):
        return "".join(part["text"] for part in content)
    raise InvalidArgumentError(f"messages[{index}].content", "must be a string or a list of text parts")


# --- responses ------------------------------------------------------------------------------------------------


def usage_body(final: Final) -> dict[str, int]:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
    }


def speculation_body(final: Final) -> dict[str, Any]:
    stats = final.stats
    return {**asdict(stats), "mean_accepted_length": stats.mean_accepted_length}


class _Call:
    """One request to a generation endpoint: its ids, wire shape (completion or chat) and accumulated output."""

    def __init__(self, frontend: Frontend, chat: bool, model: str) -> None:
        self.frontend = frontend
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []

    def _token_texts(self, token_ids: list[int]) -> list[str]:
        tokenizer = self.frontend.tokenizer
        return [tokenizer.decode([token]) if tokenizer else str(token) for token in token_ids]

    def logprobs_body(self, token_ids: list[int], logprobs: list[float]) -> dict[str, Any]:
        tokens = self._token_texts(token_ids)
        if self.chat:
            entries = [
                {"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(tokens, logprobs, strict=True)
            ]
            return {"content": entries}
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": None}

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def stream_choice(self, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return choice

    def full_body(self, final: Final, want_logprobs: bool) -> dict[str, Any]:
        text = "".join(self.text)
        logprobs = self.logprobs_body(self.token_ids, self.logprobs) if want_logprobs else None
        choice: dict[str, Any] = {"index": 0, "logprobs": logprobs, "finish_reason": final.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        body = self.envelope([choice], chunk=False)
        body["usage"] = usage_body(final)
        body["speculation"] = speculation_body(final)
        return body


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidArgumentError("body", f"is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    return body


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    frontend = request.app[FRONTEND_KEY]
    try:
        body = await _json_body(request)
        generate_input = chat_input(body) if chat else completion_input(body)
        stream = _typed(body, "stream", "boolean", False)
    except InvalidArgumentError as error:  # later failures are counted by the frontend
        frontend.metrics.request_failed(error)
        raise
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    default_max_tokens = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    plan = await asyncio.to_thread(frontend.plan, generate_input, default_max_tokens=default_max_tokens)
    call = _Call(frontend, chat, generate_input.model or frontend.config.model)
    if not stream:

        async def collect(chunk: Chunk) -> None:
            call.text.append(chunk.text)
            call.token_ids.extend(chunk.token_ids)
            call.logprobs.extend(chunk.logprobs)

        final = await frontend.generate(plan, collect)
        return web.json_response(
            call.full_body(final, plan.logprobs), dumps=lambda o: json.dumps(o, ensure_ascii=False)
        )
    return await _stream(request, frontend, call, plan, include_usage)


async def _stream(
    request: web.Request, frontend: Frontend, call: _Call, plan: Plan, include_usage: bool
) -> web.StreamResponse:
    """Server-sent events; headers go out with the first chunk, so an early failure is still a plain error."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    async def start() -> None:
        if response.prepared:
            return
        await response.prepare(request)
        if call.chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            await response.write(_sse(call.envelope([first], chunk=True)))

    async def emit(chunk: Chunk) -> None:
        await start()
        logprobs = call.logprobs_body(list(chunk.token_ids), list(chunk.logprobs)) if plan.logprobs else None
        if chunk.text or logprobs:
            await response.write(_sse(call.envelope([call.stream_choice(chunk.text, None, logprobs)], chunk=True)))

    try:
        final = await frontend.generate(plan, emit)
    except SpecdecError as error:
        if not response.prepared:
            return error_response(error, frontend.config.retry_after_s)
        _, body, _ = error_status(error, frontend.config.retry_after_s)
        await response.write(_sse(body))
        await response.write(_sse("[DONE]"))
        return response
    await start()
    last = call.envelope([call.stream_choice("", final.finish_reason, None)], chunk=True)
    last["speculation"] = speculation_body(final)
    await response.write(_sse(last))
    if include_usage:
        usage = call.envelope([], chunk=True)
        usage["usage"] = usage_body(final)
        await response.write(_sse(usage))
    await response.write(_sse("[DONE]"))
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    model = request.app[FRONTEND_KEY].config.model
    return web.json_response(
        {"object": "list", "data": [{"id": model, "object": "model", "created": _CREATED, "owned_by": "specdec"}]}
    )


async def health(request: web.Request) -> web.Response:
    ready = request.app[FRONTEND_KEY].ready()
    return web.json_response({"status": "ok" if ready else "unavailable"}, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[FRONTEND_KEY].metrics.registry
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer token on ``/v1/*``; domain errors as OpenAI-style JSON errors."""
    frontend = request.app[FRONTEND_KEY]
    try:
        if request.path.startswith("/v1/"):
            frontend.authorize(request.headers.get("Authorization"))
        return await handler(request)
    except SpecdecError as error:
        return error_response(error, frontend.config.retry_after_s)


def build_app(frontend: Frontend) -> web.Application:
    """The aiohttp application serving ``frontend``."""
    app = web.Application(middlewares=[errors_and_auth], client_max_size=MAX_BODY_BYTES)
    app[FRONTEND_KEY] = frontend
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
