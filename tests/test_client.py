"""The client SDK (specdec.client) against a scripted ``specdec.v1.Router`` server: request encoding, results,
streaming, deadlines, bearer tokens and the mapping of status codes to typed errors, sync and asyncio."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
from specdec_wire.v1 import router_pb2, router_pb2_grpc

from grpc_common.server import RunningServer, start_server
from specdec import client as sdk
from specdec.client import (
    AsyncClient,
    Client,
    ClientError,
    DeadlineExceeded,
    InvalidArgument,
    Overloaded,
    Unauthenticated,
    Unavailable,
    build_request,
)


class ScriptedRouter(router_pb2_grpc.RouterServicer):
    """Answers Generate with three chunks and a final message, or with the status set in ``fail``."""

    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.fail: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None
        self.delay_s = 0.0

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if self.fail is not None:
            code, details, trailing = self.fail
            context.set_trailing_metadata(trailing)
            context.abort(code, details)
        for index, text in enumerate(["Hel", "lo", " world"]):
            time.sleep(self.delay_s)
            yield router_pb2.GenerateResponse(token_ids=[10 + index], text=text, logprobs=[-0.25])
        stats = router_pb2.SpeculationStats(
            rounds=2, draft_tokens=4, accepted_tokens=1, accepted_per_position=[1], draft_ns=2_000_000,
            verify_ns=3_000_000, state_ns=1_000_000, pipeline_hits=1, pipeline_misses=1, wire_bytes=99,
        )  # fmt: skip
        usage = router_pb2.Usage(prompt_tokens=len(request.prompt_ids) or 1, completion_tokens=3)
        yield router_pb2.GenerateResponse(finish_reason="length", usage=usage, stats=stats)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ScriptedRouter, RunningServer]]:
    servicer = ScriptedRouter()
    running = start_server(lambda s: router_pb2_grpc.add_RouterServicer_to_server(servicer, s), ["specdec.v1.Router"])
    yield servicer, running
    running.stop(0)


@pytest.fixture
def scripted(server) -> Iterator[ScriptedRouter]:
    servicer, _ = server
    yield servicer
    servicer.fail, servicer.delay_s = None, 0.0
    servicer.requests.clear()
    servicer.metadata.clear()


@pytest.fixture
def address(server) -> str:
    return server[1].address


def test_build_request_encodes_every_option() -> None:
    request = build_request(
        "hi",
        None,
        {
            "chat": True, "model": "m", "max_tokens": 9, "temperature": 0.0, "top_k": 5, "top_p": 0.9, "min_p": 0.1,
            "seed": 0, "stop": ["\n"], "ignore_eos": True, "speculation": "sequential", "drafter": "ngram",
            "num_draft_tokens": 3, "tree_width": 2, "tree_budget": 5, "logprobs": True,
        },
    )  # fmt: skip
    assert request.prompt == "hi" and request.chat and request.model == "m" and request.max_tokens == 9
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.top_k == 5 and request.sampling.top_p == pytest.approx(0.9)
    assert request.HasField("seed") and request.seed == 0
    assert list(request.stop) == ["\n"] and request.ignore_eos and request.logprobs
    assert request.speculation == router_pb2.SPECULATION_MODE_SEQUENTIAL
    assert (request.drafter, request.num_draft_tokens, request.tree_width, request.tree_budget) == ("ngram", 3, 2, 5)


def test_build_request_defaults_leave_choices_to_the_server() -> None:
    request = build_request(None, [1, 2], {})
    assert list(request.prompt_ids) == [1, 2] and request.max_tokens == sdk.DEFAULT_MAX_TOKENS
    assert not request.sampling.HasField("temperature") and not request.sampling.HasField("top_p")
    assert not request.HasField("seed") and request.speculation == router_pb2.SPECULATION_MODE_UNSPECIFIED
    with pytest.raises(TypeError, match="nonsense"):
        build_request("x", None, {"nonsense": 1})  # type: ignore[typeddict-unknown-key]
    with pytest.raises(ValueError, match="speculation"):
        build_request("x", None, {"speculation": "turbo"})  # type: ignore[typeddict-item]


def test_generate_accumulates_the_stream(scripted: ScriptedRouter, address: str) -> None:
    with Client(address, timeout_s=5, bearer_token="tok") as client:
        result = client.generate(prompt_ids=[1, 2, 3], max_tokens=3, temperature=0.0)
    assert (result.text, result.token_ids, result.finish_reason) == ("Hello world", [10, 11, 12], "length")
    assert result.logprobs == [-0.25] * 3
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (3, 3)
    stats = result.stats
    assert (stats.rounds, stats.draft_tokens, stats.accepted_tokens, stats.accepted_per_position) == (2, 4, 1, [1])
    assert (stats.draft_s, stats.verify_s, stats.state_s) == pytest.approx((0.002, 0.003, 0.001))
    assert (stats.pipeline_hits, stats.pipeline_misses, stats.wire_bytes) == (1, 1, 99)
    assert stats.mean_accepted_length == pytest.approx(1.5)
    assert result.elapsed_s > 0 and result.tokens_per_s > 0
    assert scripted.metadata[-1]["authorization"] == "Bearer tok"


def test_stream_yields_chunks_and_a_final_one(scripted: ScriptedRouter, address: str) -> None:
    with Client(address, timeout_s=5) as client:
        chunks = list(client.stream("hi", max_tokens=3))
    assert [chunk.text for chunk in chunks] == ["Hel", "lo", " world", ""]
    assert [chunk.finish_reason for chunk in chunks] == [None, None, None, "length"]
    assert chunks[-1].usage is not None and chunks[-1].stats is not None
    assert "authorization" not in scripted.metadata[-1]


ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.INTERNAL: ClientError,
}


@pytest.mark.parametrize("code", list(ERRORS), ids=lambda code: code.name)
def test_status_codes_become_typed_errors(scripted: ScriptedRouter, address: str, code: grpc.StatusCode) -> None:
    scripted.fail = (code, "max_tokens: must be >= 1", ())
    with Client(address, timeout_s=5) as client, pytest.raises(ClientError) as raised:
        client.generate("hi")
    assert type(raised.value) is ERRORS[code]
    assert (raised.value.code, raised.value.details) == (code, "max_tokens: must be >= 1")


def test_overloaded_carries_the_retry_hint(scripted: ScriptedRouter, address: str) -> None:
    scripted.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", "1500"),))
    with Client(address, timeout_s=5) as client, pytest.raises(Overloaded) as raised:
        client.generate("hi")
    assert raised.value.retry_after_s == pytest.approx(1.5)
    scripted.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", ())
    with Client(address, timeout_s=5) as client, pytest.raises(Overloaded) as raised:
        client.generate("hi")
    assert raised.value.retry_after_s is None


def test_every_call_has_a_deadline(scripted: ScriptedRouter, address: str) -> None:
    scripted.delay_s = 0.2
    with Client(address, timeout_s=0.1) as client:
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.generate("hi")
        assert time.monotonic() - started < 0.3
        assert client.generate("hi", timeout_s=5).finish_reason == "length"  # a per-call deadline wins


def test_unreachable_router_is_unavailable() -> None:
    with Client("127.0.0.1:1", timeout_s=2) as client, pytest.raises(Unavailable):
        client.generate("hi")


def test_async_client(scripted: ScriptedRouter, address: str) -> None:
    async def main() -> None:
        async with AsyncClient(address, timeout_s=5, bearer_token="t") as client:
            results = await asyncio.gather(*(client.generate(prompt_ids=[i + 1]) for i in range(3)))
            assert all(result.text == "Hello world" for result in results)
            chunks = [chunk async for chunk in client.stream("hi")]
            assert chunks[-1].finish_reason == "length"
            scripted.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("grpc-retry-pushback-ms", "250"),))
            with pytest.raises(Overloaded) as raised:
                await client.generate("hi")
            assert raised.value.retry_after_s == pytest.approx(0.25)

    asyncio.run(main())
    assert scripted.metadata[0]["authorization"] == "Bearer t"


def test_tls_takes_credentials(address: str) -> None:
    """``tls=True`` dials with TLS: a plaintext server cannot complete the handshake."""
    with Client(address, timeout_s=1, tls=True) as client, pytest.raises(ClientError):
        client.generate("hi")
    credentials = grpc.ssl_channel_credentials()
    with Client(address, timeout_s=1, tls=credentials) as client, pytest.raises(ClientError):
        client.generate("hi")


def test_several_routers_are_one_target_whose_calls_go_round_robin(address: str) -> None:
    """``router_target`` over two routers' addresses: one client's calls reach both, in turn (gRPC's round_robin,
    which the clients set; pick_first would send all of them to the first). Both clients, sync and asyncio."""
    second = ScriptedRouter()
    other = start_server(lambda s: router_pb2_grpc.add_RouterServicer_to_server(second, s), ["specdec.v1.Router"])
    try:
        target = sdk.router_target([address, other.address])
        assert target == f"ipv4:{address},{other.address}"
        with Client(target, timeout_s=5) as client:
            client.generate("warm")  # both subchannels connect while this one is served
            time.sleep(0.2)
            before = len(second.requests)
            for index in range(20):
                client.generate(prompt_ids=[index + 1])
        assert len(second.requests) - before == 10  # exactly every other call once both are connected

        async def main() -> None:
            async with AsyncClient(target, timeout_s=5) as client:
                await client.generate("warm")
                await asyncio.sleep(0.2)
                await asyncio.gather(*(client.generate(prompt_ids=[i + 1]) for i in range(20)))

        before = len(second.requests)
        asyncio.run(main())
        assert len(second.requests) - before in range(9, 12)  # the warm call went to one of the two
    finally:
        other.stop(0)
    assert sdk.router_target([address]) == address
    with pytest.raises(ValueError, match="dns:///"):
        sdk.router_target(["router-0:50051", "router-1:50051"])
    with pytest.raises(ValueError, match="do not mix"):
        sdk.router_target(["127.0.0.1:1", "[::1]:2"])
