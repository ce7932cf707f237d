"""The two ways to reach the router: its gRPC API through the SDK, and its OpenAI-compatible HTTP API (SSE).

Both take one router or several (``specdec up --num-routers N``): request ``i`` goes to router ``i mod N``, so a
load spreads evenly and each router's share is known. Both stream, time every token-carrying chunk on the client's
clock, and turn every failure (refused connection,
timeout, 429, a 5xx, an error in the middle of a stream) into a record with ``error`` set instead of raising: a
load test must count failed requests, not lose them. Use a backend as an async context manager inside the event
loop that sends (the gRPC channel and the HTTP session belong to that loop).
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import aiohttp

from bench.load.records import RequestError, RequestRecord, speculation_from_http
from bench.load.workload import Prompt, RequestOptions
from specdec.client import AsyncClient, ClientError

_HTTP_KINDS = {400: "invalid_argument", 401: "unauthenticated", 429: "resource_exhausted", 503: "unavailable"}
_OPENAI_KINDS = {
    "invalid_request_error": "invalid_argument",
    "authentication_error": "unauthenticated",
    "rate_limit_error": "resource_exhausted",
    "service_unavailable": "unavailable",
}


def _routers(addresses: str | Sequence[str]) -> list[str]:
    routers = [addresses] if isinstance(addresses, str) else list(addresses)
    if not routers:
        raise ValueError("a backend needs at least one router address")
    return routers


class Backend(Protocol):
    """Sends one request and reports it; ``send`` never raises (failures are records with ``error``)."""

    name: str

    async def __aenter__(self) -> Backend: ...

    async def __aexit__(self, *exc_info: object) -> None: ...

    async def send(self, prompt: Prompt, options: RequestOptions) -> RequestRecord: ...


@dataclass
class _Timer:
    """Client-side timing of one request (``time.perf_counter`` seconds)."""

    start: float
    ttft: float | None = None
    chunks: list[float] = field(default_factory=list)

    def chunk(self) -> None:
        elapsed = time.perf_counter() - self.start
        self.ttft = elapsed if self.ttft is None else self.ttft
        self.chunks.append(elapsed)

    def record(self, prompt: Prompt, error: RequestError | None = None, **fields: Any) -> RequestRecord:
        return RequestRecord(
            index=0,
            prompt_id=prompt.id,
            category=prompt.category,
            start_s=self.start,
            end_s=time.perf_counter(),
            ttft_s=self.ttft,
            chunk_times_s=self.chunks,
            error=error,
            **fields,
        )


class GrpcBackend:
    """``specdec.v1.Router/Generate`` through :class:`specdec.client.AsyncClient`s: ``channels`` channels per router
    (distinct channel arguments, so each gets its own HTTP/2 connection), requests round-robin over the routers and,
    per router, over its channels.

    One connection carrying a thousand concurrent streams is a client-side bottleneck of its own: past the
    connection's stream limit gRPC refuses new streams (CANCELLED within a millisecond), which is not the server's
    doing. A pool of connections, as gRPC's performance guide advises, keeps the load on the router.
    """

    name = "grpc"

    def __init__(
        self,
        address: str | Sequence[str],
        timeout_s: float = 600.0,
        bearer_token: str | None = None,
        channels: int = 8,
    ) -> None:
        self.addresses = _routers(address)
        self.timeout_s = timeout_s
        self.bearer_token = bearer_token
        self.channels = channels
        self._clients: list[AsyncClient] = []
        self._next = itertools.count()

    async def __aenter__(self) -> GrpcBackend:
        self._clients = [  # router-major within each channel index: consecutive requests alternate routers
            AsyncClient(
                address,
                timeout_s=self.timeout_s,
                bearer_token=self.bearer_token,
                channel_options=[("specdec.bench_channel", index)],
            )
            for index in range(self.channels)
            for address in self.addresses
        ]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        clients, self._clients = self._clients, []
        for client in clients:
            await client.close()

    async def send(self, prompt: Prompt, options: RequestOptions) -> RequestRecord:
        assert self._clients, "use the backend as an async context manager"
        client = self._clients[next(self._next) % len(self._clients)]
        timer = _Timer(time.perf_counter())
        try:
            last = None
            stream = client.stream(prompt.text, chat=options.chat, **options.wire_options())  # type: ignore[arg-type]
            async for chunk in stream:
                if chunk.token_ids:
                    timer.chunk()
                last = chunk
            if last is None or last.usage is None or last.stats is None:
                return timer.record(prompt, RequestError("internal", "the stream ended without a final message"))
        except ClientError as error:
            return timer.record(prompt, RequestError(error.code.name.lower(), error.details))
        except Exception as error:  # a load generator keeps going; the record says what happened
            return timer.record(prompt, RequestError("internal", f"{type(error).__name__}: {error}"))
        return timer.record(
            prompt,
            prompt_tokens=last.usage.prompt_tokens,
            output_tokens=last.usage.completion_tokens,
            finish_reason=last.finish_reason,
            speculation=asdict(last.stats),
        )


class HttpBackend:
    """``POST /v1/chat/completions`` (``options.chat``) or ``/v1/completions`` with ``"stream": true`` and usage,
    requests round-robin over the routers' base URLs."""

    name = "http"

    def __init__(
        self, base_url: str | Sequence[str], timeout_s: float = 600.0, bearer_token: str | None = None
    ) -> None:
        self.base_urls = [url.rstrip("/") for url in _routers(base_url)]
        self._next = itertools.count()
        self.timeout_s = timeout_s
        self.bearer_token = bearer_token
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpBackend:
        headers = {"Authorization": f"Bearer {self.bearer_token}"} if self.bearer_token else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            connector=aiohttp.TCPConnector(limit=0),  # no client-side cap on concurrent requests
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @staticmethod
    def body(prompt: Prompt, options: RequestOptions) -> dict[str, Any]:
        """The request body: the OpenAI fields plus the router's extensions, streamed with usage."""
        body: dict[str, Any] = {**options.wire_options(), "stream": True, "stream_options": {"include_usage": True}}
        if options.chat:
            body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            body["prompt"] = prompt.text
        return body

    async def send(self, prompt: Prompt, options: RequestOptions) -> RequestRecord:
        assert self._session is not None, "use the backend as an async context manager"
        path = "/v1/chat/completions" if options.chat else "/v1/completions"
        base_url = self.base_urls[next(self._next) % len(self.base_urls)]
        timer = _Timer(time.perf_counter())
        try:
            async with self._session.post(base_url + path, json=self.body(prompt, options)) as response:
                if response.status != 200:
                    text = await response.text()
                    kind = _HTTP_KINDS.get(response.status, f"http_{response.status}")
                    return timer.record(prompt, RequestError(kind, f"HTTP {response.status}: {text[:500]}"))
                return await self._read_stream(response, prompt, options, timer)
        except TimeoutError:
            return timer.record(prompt, RequestError("deadline_exceeded", f"no answer within {self.timeout_s} s"))
        except aiohttp.ClientConnectionError as error:
            return timer.record(prompt, RequestError("unavailable", f"{type(error).__name__}: {error}"))
        except Exception as error:  # a load generator keeps going; the record says what happened
            return timer.record(prompt, RequestError("internal", f"{type(error).__name__}: {error}"))

    @staticmethod
    async def _read_stream(
        response: aiohttp.ClientResponse, prompt: Prompt, options: RequestOptions, timer: _Timer
    ) -> RequestRecord:
        finish_reason, usage, speculation = None, None, None
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
                kind = _OPENAI_KINDS.get(error.get("type"), "internal")
                return timer.record(prompt, RequestError(kind, str(error.get("message"))))
            for choice in event.get("choices", ()):
                text = choice.get("delta", {}).get("content") if options.chat else choice.get("text")
                if text:
                    timer.chunk()
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = event.get("usage") or usage
            speculation = event.get("speculation") or speculation
        if finish_reason is None or usage is None:
            return timer.record(prompt, RequestError("internal", "the stream ended without finish_reason and usage"))
        return timer.record(
            prompt,
            prompt_tokens=usage["prompt_tokens"],
            output_tokens=usage["completion_tokens"],
            finish_reason=finish_reason,
            speculation=speculation_from_http(speculation) if speculation else None,
        )


def make_backend(kind: str, address: str | Sequence[str], timeout_s: float, bearer_token: str | None = None) -> Backend:
    """``grpc`` (``address`` = HOST:PORT, or several) or ``http`` (``address`` = base URL, or several)."""
    if kind == "grpc":
        return GrpcBackend(address, timeout_s, bearer_token)
    if kind == "http":
        return HttpBackend(address, timeout_s, bearer_token)
    raise ValueError(f"backend must be grpc or http, got {kind!r}")
