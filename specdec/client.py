"""The client SDK for the router's public gRPC API (``specdec.v1.Router``), synchronous and asyncio.

>>> with Client("127.0.0.1:50051", timeout_s=30) as client:                      # doctest: +SKIP
...     result = client.generate("Write a haiku.", chat=True, max_tokens=64, temperature=0.7, seed=1)
...     print(result.text, result.finish_reason, result.stats.mean_accepted_length)
...     for chunk in client.stream(prompt_ids=[1, 2, 3], max_tokens=16):
...         print(chunk.token_ids, chunk.text)

Against a router serving TLS, pass ``tls=TlsFiles(ca="ca.pem", cert="client.pem", key="client-key.pem")``: the
router's certificate must chain to ``ca`` and, when the router requires client certificates (mutual TLS, its
default with TLS on), ``cert``/``key`` are the client's.

Several routers serving the same workers (``specdec up --num-routers N``) are one ``address``: the clients set
gRPC's ``round_robin`` load-balancing policy, so their calls spread over every address the target resolves to
(the default, ``pick_first``, would send them all to the first). On one machine :func:`router_target` makes that
target of the addresses ``specdec status`` lists; on Kubernetes it is ``dns:///`` and the headless Service
(``dns:///specdec-router-headless.specdec.svc.cluster.local:50051``), whose DNS name resolves to every ready router
pod. A single ``host:port`` works as before. An ``ipv4:`` target carries no host name, so with TLS set
``TlsFiles.server_name`` to a name the routers' certificate holds.

Every call carries a deadline (``timeout_s``, per client or per call). Failures raise a :class:`ClientError`
subclass chosen by status code: :class:`InvalidArgument` (the message names the field), :class:`Overloaded`
(with ``retry_after_s`` from the server's pushback), :class:`Unavailable`, :class:`DeadlineExceeded`,
:class:`Unauthenticated`. This is the one module of :mod:`specdec` that imports gRPC.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict, Unpack

import grpc
import grpc.aio
from specdec_wire.v1 import common_pb2, router_pb2, router_pb2_grpc

RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"
LB_POLICY_OPTION = "grpc.lb_policy_name"
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_TOKENS = 64
_MODES = {
    None: router_pb2.SPECULATION_MODE_UNSPECIFIED,
    "off": router_pb2.SPECULATION_MODE_OFF,
    "sequential": router_pb2.SPECULATION_MODE_SEQUENTIAL,
    "pipelined": router_pb2.SPECULATION_MODE_PIPELINED,
    "auto": router_pb2.SPECULATION_MODE_AUTO,
}


# --- errors ---------------------------------------------------------------------------------------------------


class ClientError(Exception):
    """A call to the router failed; ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(ClientError):
    """The request was refused; ``details`` names the field (e.g. ``"max_tokens: must be >= 1, got 0"``)."""


class Overloaded(ClientError):
    """The router is at capacity; retry after ``retry_after_s`` seconds (None when the server gave no hint)."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None) -> None:
        super().__init__(code, details)
        self.retry_after_s = retry_after_s


class Unavailable(ClientError):
    """The router, or every verifier behind it, cannot be reached."""


class DeadlineExceeded(ClientError):
    """The call did not finish within its deadline."""


class Unauthenticated(ClientError):
    """The router requires a bearer token and did not get the right one."""


_ERRORS: dict[grpc.StatusCode, type[ClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
}


def _client_error(error: grpc.RpcError, trailing: Sequence[tuple[str, str | bytes]] | None) -> ClientError:
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        hint = dict(trailing or ()).get(RETRY_PUSHBACK_KEY)
        return Overloaded(code, details, int(hint) / 1000 if hint is not None else None)
    return _ERRORS.get(code, ClientError)(code, details)


# --- results --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Stats:
    """Speculation counters of one request (DESIGN §7)."""

    rounds: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    rounds_per_draft_size: list[int]  # [n]: rounds that proposed n draft tokens (under auto: the lengths chosen)
    draft_s: float
    verify_s: float
    state_s: float
    pipeline_hits: int
    pipeline_misses: int
    wire_bytes: int
    feature_bytes: int
    drafter_fallback: bool
    pipeline_rejection_hits: int = 0  # of pipeline_hits: pre-drafts prepared for a rejection verdict

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted / rounds."""
        return 1 + self.accepted_tokens / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class Chunk:
    """One streamed message: newly committed tokens and their text; the last one also ends the request.

    ``text`` may lag ``token_ids`` (an incomplete character, or a possible start of a stop string, is held).
    ``finish_reason`` (``"stop"`` or ``"length"``), ``usage`` and ``stats`` are set on the last chunk only.
    ``logprobs`` (option ``logprobs``) has one log-probability per token; ``top_logprobs`` (option
    ``top_logprobs``) one list per token of ``(token id, logprob)`` alternatives, most probable first.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None = None
    usage: Usage | None = None
    stats: Stats | None = None
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class GenerateResult:
    """A whole generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    stats: Stats
    logprobs: list[float]
    elapsed_s: float
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as the router sees it: ``role`` is ``"drafter"`` or ``"verifier"``; ``kind`` a drafter's kind
    (``ngram``, ``model``, ``early-exit``, ``eagle``; empty until the drafter has answered a status call)."""

    role: str
    address: str
    healthy: bool
    outstanding: int
    kind: str


@dataclass(frozen=True)
class RouterStatus:
    """The router's ``Status``: served model, workers, requests running and waiting."""

    model: str
    workers: list[WorkerInfo]
    running: int
    waiting: int


def status_from_wire(reply: router_pb2.RouterStatusReply) -> RouterStatus:
    workers = [WorkerInfo(w.role, w.address, w.healthy, w.outstanding, w.kind) for w in reply.workers]
    return RouterStatus(reply.model, workers, reply.running, reply.waiting)


class GenerateOptions(TypedDict, total=False):
    """Keyword options of :meth:`Client.generate` and :meth:`Client.stream` (server defaults when omitted)."""

    chat: bool  # wrap the text prompt in the model's chat template
    model: str
    max_tokens: int  # default DEFAULT_MAX_TOKENS
    temperature: float  # 0 is greedy
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: Sequence[str]
    ignore_eos: bool
    speculation: Literal["off", "sequential", "pipelined", "auto"]
    drafter: str  # "none", "ngram", "model" or "early-exit"
    num_draft_tokens: int
    tree_width: int
    tree_budget: int
    logprobs: bool
    top_logprobs: int  # with logprobs: alternatives per token, 0 to 20


def build_request(
    prompt: str | None, prompt_ids: Sequence[int] | None, options: GenerateOptions
) -> router_pb2.GenerateRequest:
    """The wire request for ``prompt`` or ``prompt_ids`` with ``options``."""
    unknown = set(options) - set(GenerateOptions.__annotations__)
    if unknown:
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    sampling = common_pb2.SamplingParams(top_k=options.get("top_k", 0), min_p=options.get("min_p", 0.0))
    if "temperature" in options:
        sampling.temperature = options["temperature"]
    if "top_p" in options:
        sampling.top_p = options["top_p"]
    speculation = options.get("speculation")
    if speculation not in _MODES:
        raise ValueError(f"speculation must be one of off, sequential, pipelined, auto, got {speculation!r}")
    request = router_pb2.GenerateRequest(
        prompt=prompt or "",
        prompt_ids=list(prompt_ids or ()),
        chat=options.get("chat", False),
        model=options.get("model", ""),
        sampling=sampling,
        max_tokens=options.get("max_tokens", DEFAULT_MAX_TOKENS),
        stop=list(options.get("stop", ())),
        ignore_eos=options.get("ignore_eos", False),
        speculation=_MODES[speculation],
        drafter=options.get("drafter", ""),
        num_draft_tokens=options.get("num_draft_tokens", 0),
        tree_width=options.get("tree_width", 0),
        tree_budget=options.get("tree_budget", 0),
        logprobs=options.get("logprobs", False),
        top_logprobs=options.get("top_logprobs", 0),
    )
    if "seed" in options:
        request.seed = options["seed"]
    return request


def chunk_from_wire(message: router_pb2.GenerateResponse) -> Chunk:
    top_logprobs = [list(zip(top.token_ids, top.logprobs, strict=True)) for top in message.top_logprobs]
    if not message.finish_reason:
        return Chunk(list(message.token_ids), message.text, list(message.logprobs), top_logprobs=top_logprobs)
    stats = message.stats
    return Chunk(
        list(message.token_ids),
        message.text,
        list(message.logprobs),
        top_logprobs=top_logprobs,
        finish_reason=message.finish_reason,
        usage=Usage(message.usage.prompt_tokens, message.usage.completion_tokens),
        stats=Stats(
            rounds=stats.rounds,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            accepted_per_position=list(stats.accepted_per_position),
            rounds_per_draft_size=list(stats.rounds_per_draft_size),
            draft_s=stats.draft_ns / 1e9,
            verify_s=stats.verify_ns / 1e9,
            state_s=stats.state_ns / 1e9,
            pipeline_hits=stats.pipeline_hits,
            pipeline_misses=stats.pipeline_misses,
            wire_bytes=stats.wire_bytes,
            feature_bytes=stats.feature_bytes,
            drafter_fallback=stats.drafter_fallback,
            pipeline_rejection_hits=stats.pipeline_rejection_hits,
        ),
    )


class _Accumulator:
    """Chunks → :class:`GenerateResult`."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.top_logprobs.extend(chunk.top_logprobs)
        self.last = chunk

    def result(self) -> GenerateResult:
        last = self.last
        if last is None or last.finish_reason is None or last.usage is None or last.stats is None:
            raise ClientError(grpc.StatusCode.INTERNAL, "the stream ended without a final message")
        elapsed = time.perf_counter() - self.started
        return GenerateResult(
            "".join(self.text),
            self.token_ids,
            last.finish_reason,
            last.usage,
            last.stats,
            self.logprobs,
            elapsed,
            self.top_logprobs,
        )


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS connection to a server (the router, or a worker the router dials).

    ``ca``: the roots the server's certificate must chain to (None: the system's). ``cert`` and ``key``: the client
    certificate presented to a server that asks for one (mutual TLS); both or neither. ``server_name``: the name
    the server's certificate is checked against (None: the host dialled), for servers whose addresses are not in
    their certificates (pods behind changing IPs sharing one certificate).
    """

    ca: str | Path | None = None
    cert: str | Path | None = None
    key: str | Path | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both cert and key")

    def credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials from the files, read now."""

        def read(path: str | Path | None) -> bytes | None:
            return Path(path).read_bytes() if path is not None else None

        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel options that make the handshake check ``server_name`` instead of the dialled host."""
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _credentials(tls: bool | grpc.ChannelCredentials | TlsFiles) -> grpc.ChannelCredentials | None:
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    if isinstance(tls, TlsFiles):
        return tls.credentials()
    return grpc.ssl_channel_credentials() if tls else None


def _tls_options(tls: bool | grpc.ChannelCredentials | TlsFiles) -> list[tuple[str, str]]:
    return tls.channel_options() if isinstance(tls, TlsFiles) else []


def _channel_options(
    tls: bool | grpc.ChannelCredentials | TlsFiles, options: Sequence[tuple[str, str | int]] = ()
) -> list[tuple[str, str | int]]:
    """``options`` and the TLS ones, with ``round_robin`` unless ``options`` choose a policy themselves."""
    balancing = [] if any(name == LB_POLICY_OPTION for name, _ in options) else [(LB_POLICY_OPTION, "round_robin")]
    return [*balancing, *options, *_tls_options(tls)]


def router_target(addresses: Sequence[str]) -> str:
    """One gRPC target over several routers' ``host:port`` addresses, host an IP literal (what ``specdec status``
    lists); the clients spread their calls over it round-robin. One address is returned as it is.

    >>> router_target(["127.0.0.1:50051", "127.0.0.1:50052"])
    'ipv4:127.0.0.1:50051,127.0.0.1:50052'
    >>> router_target(["[::1]:50051", "[::1]:50052"])
    'ipv6:[::1]:50051,[::1]:50052'
    """
    if not addresses:
        raise ValueError("router_target needs at least one address")
    if len(addresses) == 1:
        return addresses[0]
    families = set()
    for address in addresses:
        host = address.rsplit(":", 1)[0].removeprefix("[").removesuffix("]")
        try:
            families.add(ipaddress.ip_address(host).version)
        except ValueError:
            raise ValueError(f"{address!r}: a multi-router target needs IP addresses; for names use dns:///") from None
    if len(families) > 1:
        raise ValueError(f"{list(addresses)}: IPv4 and IPv6 addresses do not mix in one target")
    return f"ipv{families.pop()}:{','.join(addresses)}"


def _metadata(bearer_token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {bearer_token}"),) if bearer_token else ()


# --- clients --------------------------------------------------------------------------------------------------


class Client:
    """Synchronous client. ``tls``: False (plaintext), True (system roots), :class:`TlsFiles` (a CA, a client
    certificate) or explicit channel credentials.

    Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: bool | grpc.ChannelCredentials | TlsFiles = False,
        bearer_token: str | None = None,
    ) -> None:
        credentials = _credentials(tls)
        options = _channel_options(tls)
        self._channel = (
            grpc.secure_channel(address, credentials, options)
            if credentials
            else grpc.insecure_channel(address, options)
        )
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.timeout_s = timeout_s
        self._metadata = _metadata(bearer_token)

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Iterator[Chunk]:
        """Yield chunks as rounds commit tokens; the last one has ``finish_reason``, ``usage`` and ``stats``.

        Leaving the loop early cancels the request on the router (which frees it on every worker).
        """
        request = build_request(prompt, prompt_ids, options)
        call = self._stub.Generate(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        try:
            for message in call:
                yield chunk_from_wire(message)
        except grpc.RpcError as error:
            raise _client_error(error, call.trailing_metadata()) from None
        finally:
            call.cancel()

    def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Generate to completion (text prompt or ``prompt_ids``)."""
        accumulator = _Accumulator()
        for chunk in self.stream(prompt, prompt_ids=prompt_ids, timeout_s=timeout_s, **options):
            accumulator.add(chunk)
        return accumulator.result()

    def status(self, *, timeout_s: float | None = None) -> RouterStatus:
        """The router's workers (with each drafter's kind) and load."""
        try:
            reply = self._stub.Status(
                router_pb2.RouterStatusRequest(), timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _client_error(error, None) from None
        return status_from_wire(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClient:
    """The asyncio client (``grpc.aio``); create it inside the event loop that uses it. ``tls`` as :class:`Client`'s."""

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: bool | grpc.ChannelCredentials | TlsFiles = False,
        bearer_token: str | None = None,
        channel_options: Sequence[tuple[str, str | int]] = (),
    ) -> None:
        credentials = _credentials(tls)
        options = _channel_options(tls, channel_options)
        self._channel = (
            grpc.aio.secure_channel(address, credentials, options)
            if credentials
            else grpc.aio.insecure_channel(address, options)
        )
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self.timeout_s = timeout_s
        self._metadata = _metadata(bearer_token)

    async def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncIterator[Chunk]:
        """Like :meth:`Client.stream`; closing the iterator early cancels the request."""
        request = build_request(prompt, prompt_ids, options)
        call = self._stub.Generate(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        try:
            async for message in call:
                yield chunk_from_wire(message)
        except grpc.RpcError as error:
            raise _client_error(error, await call.trailing_metadata()) from None
        finally:
            call.cancel()

    async def generate(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: Sequence[int] | None = None,
        timeout_s: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> GenerateResult:
        """Generate to completion (text prompt or ``prompt_ids``)."""
        accumulator = _Accumulator()
        async for chunk in self.stream(prompt, prompt_ids=prompt_ids, timeout_s=timeout_s, **options):
            accumulator.add(chunk)
        return accumulator.result()

    async def status(self, *, timeout_s: float | None = None) -> RouterStatus:
        """Like :meth:`Client.status`."""
        try:
            reply = await self._stub.Status(
                router_pb2.RouterStatusRequest(), timeout=timeout_s or self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise _client_error(error, None) from None
        return status_from_wire(reply)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
