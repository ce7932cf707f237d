"""OpenAI-compatible HTTP on the router's event loop (aiohttp): completions, chat completions, models, health, metrics.

``POST /v1/completions`` and ``POST /v1/chat/completions`` take the OpenAI request bodies (one prompt) plus the
extensions ``top_k`` (-1 or 0: off), ``min_p``, ``ignore_eos``, ``speculation``, ``drafter``, ``num_draft_tokens``,
``tree_width`` and ``tree_budget``. ``n`` choices run as independent requests seeded ``seed + i`` (vLLM's rule).
``logprobs`` / ``top_logprobs`` (chat) and ``logprobs: N`` (completions) return the target's log-probabilities in
OpenAI's (and vLLM's) layouts. With ``"stream": true`` the answer is server-sent events, one ``data: {chunk}`` per
round that released text, each choice's last chunk carrying its ``finish_reason``, then ``data: [DONE]``; otherwise
one JSON object with ``choices`` and ``usage``. Both carry the request's speculation counters under
``"speculation"``. Errors are ``{"error": {"message", "type", "param", "code"}}``: 400 naming the field (the body
is checked whole first: valid UTF-8 JSON, no lone surrogates, at most :data:`MAX_JSON_DEPTH` deep; then every field,
numbers against what they mean and what the wire carries, in :func:`~router.requests.plan_request`, which the gRPC
API shares), 401 without the bearer token, 413 over :data:`MAX_BODY_BYTES`, 429 with ``Retry-After`` when
overloaded, 503 without a verifier. ``GET /metrics`` is the Prometheus exposition of
:class:`~router.metrics.RouterMetrics`; like ``/health`` (and vLLM's ``/metrics``) it needs no bearer token.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, fields, replace
from typing import Any, TypeVar

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
from router.pipeline import Chunk, Final, RequestStats
from router.requests import UINT64, GenerateInput, Message, Plan
from specdec.errors import CapacityError, InvalidArgumentError, SpecdecError
from specdec.sampling_params import MAX_TOP_LOGPROBS, TopLogprobs

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions API's default
MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 32  # an OpenAI body nests 4 deep (messages[i].content[j].text); far deeper is refused, not parsed on
MAX_CHOICES = 16  # the most choices (n) one request may ask for; each runs as a request of its own
# Settings this server does not implement, with the value that means "off": any other value is refused, not ignored.
UNSUPPORTED_NEUTRAL: dict[str, Any] = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "best_of": 1,
    "logit_bias": {},
    "suffix": "",
    "response_format": {"type": "text"},
    "tools": [],
}
FRONTEND_KEY = web.AppKey("frontend", Frontend)
_CREATED = int(time.time())

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


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


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object of Unicode text, at most :data:`MAX_JSON_DEPTH` deep (JSON is UTF-8, RFC 8259)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except ValueError as error:  # bad JSON, bad UTF-8, an integer over Python's digit limit
        raise InvalidArgumentError("body", f"is not valid JSON: {error}") from None
    except RecursionError:  # nesting far past the depth limit: the decoder gives up first
        raise InvalidArgumentError("body", f"is nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(body, dict):
        raise InvalidArgumentError("body", "must be a JSON object")
    _check_json(body)
    return body


def _check_json(body: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_JSON_DEPTH` and any string (or key) holding a lone surrogate, which
    JSON's ``\\ud800`` escapes can make but no tokenizer or wire encoding takes; the error names where it is."""
    containers: list[tuple[dict[str, Any] | list[Any], str, int]] = [(body, "", 1)]
    while containers:
        container, path, depth = containers.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidArgumentError("body", f"is nested deeper than {MAX_JSON_DEPTH} levels")
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            if isinstance(key, str) and not _is_unicode(key):
                raise _not_unicode(path or "body")
            if isinstance(value, str) and not _is_unicode(value):
                raise _not_unicode(_child(path, key))
            if isinstance(value, dict | list):
                containers.append((value, _child(path, key), depth + 1))


def _child(path: str, key: str | int) -> str:
    """The field name of ``key`` inside ``path``: ``prompt``, ``messages[0]``, ``messages[0].content``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _not_unicode(field: str) -> InvalidArgumentError:
    return InvalidArgumentError(field, "is not valid Unicode: it holds a lone surrogate (\\ud800-\\udfff)")


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
    if kind != "number":
        return value
    try:
        return float(value)
    except OverflowError:  # an integer literal beyond any float
        raise InvalidArgumentError(name, f"is out of range, got {str(value)[:40]}...") from None


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


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """A setting this server does not implement, at anything but its neutral value, is refused rather than ignored."""
    for name, neutral in UNSUPPORTED_NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise InvalidArgumentError(name, f"is not supported (only {json.dumps(neutral)})")


def _common(body: dict[str, Any]) -> dict[str, Any]:
    """Fields shared by completions and chat completions."""
    _refuse_unsupported(body)
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


def choices_wanted(body: dict[str, Any]) -> int:
    """``n``: how many independent choices to generate."""
    n = _typed(body, "n", "integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise InvalidArgumentError("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    return n


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
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgumentError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}")
    return GenerateInput(
        prompt=text,
        prompt_ids=ids,
        max_tokens=_typed(body, "max_tokens", "integer", COMPLETIONS_DEFAULT_MAX_TOKENS),
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
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
        top_logprobs=_typed(body, "top_logprobs", "integer", 0),
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


def choice_plans(plan: Plan, n: int) -> list[Plan]:
    """``n`` independent runs of ``plan``: choice ``i`` is seeded ``seed + i`` (vLLM's rule for ``n > 1``); the
    workers' random streams are hashed from it, so neighbouring seeds give unrelated streams."""
    return [replace(plan, seed=(plan.seed + index) % UINT64) for index in range(n)]


# --- responses ------------------------------------------------------------------------------------------------


def usage_body(finals: list[Final]) -> dict[str, int]:
    """Usage of all choices: the prompt once, every choice's completion tokens (as OpenAI counts ``n > 1``)."""
    prompt = finals[0].prompt_tokens
    completion = sum(final.completion_tokens for final in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def merged_stats(stats: list[RequestStats]) -> RequestStats:
    """The speculation counters of several choices as one: sums (per position for the accepted counts), and a
    drafter fallback if any choice had one."""
    merged = RequestStats()
    for one in stats:
        for counter in fields(RequestStats):
            mine, theirs = getattr(merged, counter.name), getattr(one, counter.name)
            if isinstance(theirs, list):
                total = [a + b for a, b in itertools.zip_longest(mine, theirs, fillvalue=0)]
            elif isinstance(theirs, bool):
                total = mine or theirs
            else:
                total = mine + theirs
            setattr(merged, counter.name, total)
    return merged


def speculation_body(finals: list[Final]) -> dict[str, Any]:
    """The ``"speculation"`` object: the choices' counters together, with their mean accepted length."""
    stats = merged_stats([final.stats for final in finals])
    return {**asdict(stats), "mean_accepted_length": stats.mean_accepted_length}


class _Choice:
    """One choice's output so far (text, tokens, log-probabilities) and where its next token's text starts."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.text_offset = 0  # characters of token text already reported (completions' text_offset)

    async def collect(self, chunk: Chunk) -> None:
        """An :data:`~router.pipeline.Emit` keeping the chunk (a response that is not streamed)."""
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.top_logprobs.extend(chunk.top_logprobs)


class _Call:
    """One request to a generation endpoint: its ids and wire shape (completion or chat)."""

    def __init__(self, frontend: Frontend, chat: bool, model: str) -> None:
        self.frontend = frontend
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def _token_text(self, token: int) -> str:
        tokenizer = self.frontend.tokenizer
        return tokenizer.decode([token]) if tokenizer else str(token)

    def logprobs_body(
        self, choice: _Choice, token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs]
    ) -> dict[str, Any]:
        """OpenAI's logprobs object for ``token_ids`` of ``choice`` (``tops``: their alternatives, maybe none).

        Chat: ``content`` entries with each token's text, logprob, UTF-8 bytes and its ``top_logprobs`` list.
        Completions (vLLM's layout): ``tokens``, ``token_logprobs``, ``top_logprobs`` (per token a dict of token text
        → logprob: the emitted token, then the alternatives) and ``text_offset`` (where each token's text starts in
        the completion).
        """
        tokens = [self._token_text(token) for token in token_ids]
        alternatives = [
            [(self._token_text(token), logprob) for token, logprob in zip(top.token_ids, top.logprobs, strict=True)]
            for top in tops
        ] or [[] for _ in tokens]
        if self.chat:
            return {
                "content": [
                    {
                        "token": token,
                        "logprob": logprob,
                        "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
                    }
                    for token, logprob, top in zip(tokens, logprobs, alternatives, strict=True)
                ]
            }
        offsets = []
        for token in tokens:
            offsets.append(choice.text_offset)
            choice.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": list(logprobs),
            "top_logprobs": [
                {token: logprob} | {t: lp for t, lp in top if t != token}
                for token, logprob, top in zip(tokens, logprobs, alternatives, strict=True)
            ],
            "text_offset": offsets,
        }

    def envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def stream_choice(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return choice

    def full_body(self, choices: list[_Choice], finals: list[Final], want_logprobs: bool) -> dict[str, Any]:
        bodies = []
        for choice, final in zip(choices, finals, strict=True):
            logprobs = (
                self.logprobs_body(choice, choice.token_ids, choice.logprobs, choice.top_logprobs)
                if want_logprobs
                else None
            )
            body: dict[str, Any] = {"index": choice.index, "logprobs": logprobs, "finish_reason": final.finish_reason}
            if self.chat:
                body["message"] = {"role": "assistant", "content": "".join(choice.text)}
            else:
                body["text"] = "".join(choice.text)
            bodies.append(body)
        response = self.envelope(bodies, chunk=False)
        response["usage"] = usage_body(finals)
        response["speculation"] = speculation_body(finals)
        return response


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _all_or_none(coroutines: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coroutines`` at once (one per choice); the first failure, or a cancellation, cancels the rest and
    escapes."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    frontend = request.app[FRONTEND_KEY]
    try:
        body = await asyncio.to_thread(parse_body, await request.read())  # a 4 MiB body: off the loop
        generate_input = chat_input(body) if chat else completion_input(body)
        n = choices_wanted(body)
        stream = _typed(body, "stream", "boolean", False)
    except InvalidArgumentError as error:  # later failures are counted by the frontend
        frontend.metrics.request_failed(error)
        raise
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    default_max_tokens = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    plan = await asyncio.to_thread(frontend.plan, generate_input, default_max_tokens=default_max_tokens)
    plans = choice_plans(plan, n)
    call = _Call(frontend, chat, generate_input.model or frontend.config.model)
    choices = [_Choice(index) for index in range(n)]
    if not stream:
        finals = await _all_or_none(
            [frontend.generate(choice_plan, choice.collect) for choice_plan, choice in zip(plans, choices, strict=True)]
        )
        return web.json_response(
            call.full_body(choices, finals, plan.logprobs), dumps=lambda o: json.dumps(o, ensure_ascii=False)
        )
    return await _stream(request, frontend, call, plans, choices, include_usage)


async def _stream(
    request: web.Request,
    frontend: Frontend,
    call: _Call,
    plans: list[Plan],
    choices: list[_Choice],
    include_usage: bool,
) -> web.StreamResponse:
    """Server-sent events; headers go out with the first chunk, so an early failure is still a plain error. Each
    choice's chunks carry its index; a choice's last chunk carries its ``finish_reason`` and speculation counters."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    started = [False] * len(plans)  # a chat choice's first chunk (its role) has gone out
    writing = asyncio.Lock()  # choices write concurrently; each event goes out whole, after the headers

    async def write(index: int, payload: dict[str, Any]) -> None:
        async with writing:
            if not response.prepared:
                await response.prepare(request)
            if call.chat and not started[index]:
                started[index] = True
                first = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                await response.write(_sse(call.envelope([{**first, "finish_reason": None}], chunk=True)))
            await response.write(_sse(payload))

    async def run(choice: _Choice, plan: Plan) -> Final:
        async def emit(chunk: Chunk) -> None:
            logprobs = None
            if plan.logprobs:
                logprobs = call.logprobs_body(choice, chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
            if chunk.text or logprobs:
                stream_choice = call.stream_choice(choice.index, chunk.text, None, logprobs)
                await write(choice.index, call.envelope([stream_choice], chunk=True))

        final = await frontend.generate(plan, emit)
        last = call.envelope([call.stream_choice(choice.index, "", final.finish_reason, None)], chunk=True)
        last["speculation"] = speculation_body([final])
        await write(choice.index, last)
        return final

    try:
        finals = await _all_or_none([run(choice, plan) for choice, plan in zip(choices, plans, strict=True)])
    except SpecdecError as error:
        if not response.prepared:
            return error_response(error, frontend.config.retry_after_s)
        _, body, _ = error_status(error, frontend.config.retry_after_s)
        await response.write(_sse(body))
        await response.write(_sse("[DONE]"))
        return response
    if include_usage:
        usage = call.envelope([], chunk=True)
        usage["usage"] = usage_body(finals)
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
