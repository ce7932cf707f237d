"""Fuzzing the public front doors (DESIGN §9): whatever a client sends, the router answers it as a client error or
serves it, never with a 5xx / INTERNAL / UNKNOWN, never hangs, and still serves a good request afterwards.

* The OpenAI HTTP body, against a router with the real SmolLM2 tokenizer (chat template, stop strings, text) over
  the fake workers of ``test_router_http``: every known field, each drawn from plausible values or from any JSON
  value at all (huge integers, NaN, lone surrogate escapes, nesting), plus raw bytes.
* The ``GenerateRequest`` over gRPC, against tiny real models (verifier, model drafter and router of
  ``test_router_distribution``): every field over its whole wire range, serialized or mutated as raw bytes.

Seeded (``derandomize``), no example database, a fixed number of examples and a per-example deadline.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from specdec_wire.v1 import common_pb2, router_pb2
from transformers import PreTrainedTokenizerBase

from drafter_service.config import DrafterConfig
from router.server import RunningRouter
from specdec.client import Client
from specdec.model_files import load_tokenizer
from tests.test_router_distribution import served_router
from tests.test_router_grpc import Stack, wait_until
from tests.tiny_models import SMOLLM2, tiny_draft, tiny_llama

CALL_TIMEOUT_S = 30  # "no hang": every answer well within this
FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=10),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
INT32 = st.integers(-(2**31), 2**31 - 1)
LONE_SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udbff\udbff"])
TEXT = st.text(max_size=12) | LONE_SURROGATES
WORDS = st.text(min_size=1, max_size=12)  # plausible text: no surrogates, never empty
NUMBERS = (
    st.integers(-3, 40)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([10**400, 2**31, 2**63, 2**64, -1, 0, 1e39, 1e-50])
)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | NUMBERS | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=10,
)


SMALL = st.integers(1, 12)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": WORDS | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}), max_size=2),
    }
)
# Each field's plausible values: mostly valid, so requests get past validation and run.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from([SMOLLM2, ""]),
    "max_tokens": SMALL,
    "max_completion_tokens": SMALL,
    "temperature": st.floats(0, 2) | st.just(0),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 10),
    "min_p": st.floats(0, 0.5),
    "seed": st.integers(0, 2**64 - 1),
    "stop": WORDS | st.lists(WORDS, max_size=3),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "speculation": st.sampled_from(["off", "sequential", "pipelined"]),
    "drafter": st.sampled_from(["none", "ngram"]),
    "num_draft_tokens": st.integers(0, 6),
    "tree_width": st.integers(0, 3),
    "tree_budget": st.integers(0, 4),
    "presence_penalty": st.just(0),
}
COMPLETION_FIELDS = {
    "prompt": WORDS | st.lists(st.integers(0, 49_151), min_size=1, max_size=6),
    "logprobs": st.integers(0, 5),
    "echo": st.just(False),
}
CHAT_FIELDS = {
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
}
WILD_NAMES = st.sampled_from([*FIELDS, *COMPLETION_FIELDS, *CHAT_FIELDS, "messages", "prompt", "role"]) | TEXT


@st.composite
def http_bodies(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: str) -> dict[str, Any]:
    """A plausible body (``required`` always set, the rest each maybe), then up to two fields set to any JSON."""
    optional = {name: value for name, value in fields.items() if name != required}
    body = draw(st.fixed_dictionaries({required: fields[required]}, optional={**FIELDS, **optional}))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        body[draw(WILD_NAMES)] = draw(ANY_JSON)
    return body


HTTP_BODY = st.one_of(
    st.tuples(
        st.just("/v1/completions"), http_bodies(COMPLETION_FIELDS, "prompt").map(lambda b: json.dumps(b).encode())
    ),
    st.tuples(
        st.just("/v1/chat/completions"), http_bodies(CHAT_FIELDS, "messages").map(lambda b: json.dumps(b).encode())
    ),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.binary(max_size=40)),
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def http_stack(tokenizer: PreTrainedTokenizerBase) -> Iterator[Stack]:
    """Fake workers, the real tokenizer; a context limit, so a valid request is bounded as on a real verifier."""
    stack = Stack(tokenizer=tokenizer, model=SMOLLM2, max_model_len=96, max_concurrent_requests=32)
    yield stack
    stack.stop()


def post(address: str, path: str, data: bytes) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def assert_served_well(address: str) -> None:
    status, data = post(address, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 3}).encode())
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] == 3, data


@settings(FUZZ, max_examples=150)
@given(case=HTTP_BODY)
def test_any_http_body_is_answered_without_a_server_error(http_stack: Stack, case: tuple[str, bytes]) -> None:
    path, data = case
    status, answer = post(http_stack.router.http_address, path, data)
    event(f"HTTP {status}")  # the outcome mix, shown by --hypothesis-show-statistics
    assert status < 500, answer
    if status == 200 and answer.startswith(b"data: "):  # streamed: an error after the headers is an event
        assert b'"internal_error"' not in answer and answer.endswith(b"data: [DONE]\n\n"), answer
    elif status != 200:
        assert status in (400, 413, 429) and json.loads(answer)["error"]["message"], answer


def test_the_http_fuzzed_router_still_serves(http_stack: Stack) -> None:
    """After the fuzzing above (same module, so the same router), a good request is served; nothing leaked."""
    assert_served_well(http_stack.router.http_address)
    assert wait_until(lambda: not http_stack.verifier.sequences and not http_stack.drafter.sequences)


# --- gRPC -------------------------------------------------------------------------------------------------------

VOCAB = 5


@pytest.fixture(scope="module")
def grpc_router() -> Iterator[RunningRouter]:
    target = tiny_llama(seed=11, vocab_size=VOCAB, num_layers=2)
    draft = tiny_draft(target, seed=12, num_layers=1, noise=0.3)
    config = DrafterConfig(kind="model", draft_model=draft.name)
    with served_router(target, config, max_model_len=48, draft=draft) as router:
        yield router


FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
PLAUSIBLE_REQUEST = st.builds(
    router_pb2.GenerateRequest,
    prompt_ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    sampling=st.builds(
        common_pb2.SamplingParams,
        temperature=st.floats(0, 2, width=32),
        top_k=st.integers(-1, 6),
        top_p=st.floats(0.0625, 1, width=32),
        min_p=st.floats(0, 0.5, width=32),
    ),
    max_tokens=st.integers(1, 12),
    seed=st.integers(0, 2**64 - 1),
    ignore_eos=st.booleans(),
    speculation=st.integers(0, 3),
    drafter=st.sampled_from(["", "none", "model"]),
    num_draft_tokens=st.integers(0, 4),
    tree_width=st.integers(0, 2),
    logprobs=st.booleans(),
)
WILD_FIELDS: dict[str, st.SearchStrategy[Any]] = {  # every field of GenerateRequest over its whole wire range
    "prompt": st.text(max_size=8),
    "prompt_ids": st.lists(INT32, max_size=6),
    "chat": st.booleans(),
    "model": st.text(max_size=8),
    "max_tokens": INT32,
    "stop": st.lists(st.text(max_size=4), max_size=2),
    "speculation": INT32,
    "drafter": st.text(max_size=8),
    "num_draft_tokens": INT32,
    "tree_width": INT32,
    "tree_budget": INT32,
    "top_logprobs": INT32 | st.integers(0, 21),
    "sampling.temperature": FLOAT32,
    "sampling.top_k": INT32,
    "sampling.top_p": FLOAT32,
    "sampling.min_p": FLOAT32,
}


@st.composite
def wire_bytes(draw: st.DrawFn) -> bytes:
    """A plausible GenerateRequest with up to three fields anywhere in their wire range, serialized; sometimes with
    bytes overwritten or appended afterwards (bad UTF-8, bad tags), or plain noise."""
    request = draw(PLAUSIBLE_REQUEST)
    if request.logprobs:
        request.top_logprobs = draw(st.integers(0, 5))
    for name in draw(st.lists(st.sampled_from(sorted(WILD_FIELDS)), max_size=3, unique=True)):
        value = draw(WILD_FIELDS[name])
        owner, _, field = name.rpartition(".")
        message = request.sampling if owner else request
        if isinstance(value, list):
            message.ClearField(field)
            getattr(message, field).extend(value)
        else:
            setattr(message, field, value)
    data = bytearray(request.SerializeToString())
    mutation = draw(st.sampled_from(["none", "none", "none", "overwrite", "append", "noise"]))
    if mutation == "overwrite" and data:
        for _ in range(draw(st.integers(1, 3))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif mutation == "append":
        data += draw(st.binary(min_size=1, max_size=8))
    elif mutation == "noise":
        data = bytearray(draw(st.binary(max_size=32)))
    return bytes(data)


ACCEPTABLE_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def raw_generate(grpc_router: RunningRouter) -> Iterator[Any]:
    """``Generate`` taking the request as raw bytes (so malformed messages reach the server)."""
    with grpc.insecure_channel(grpc_router.grpc_address) as channel:
        yield channel.unary_stream(
            "/specdec.v1.Router/Generate",
            request_serializer=lambda data: data,
            response_deserializer=router_pb2.GenerateResponse.FromString,
        )


@settings(FUZZ, max_examples=150)
@given(data=wire_bytes())
def test_any_generate_request_is_answered_without_a_server_error(raw_generate: Any, data: bytes) -> None:
    try:
        responses = list(raw_generate(data, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        event(error.code().name)  # the outcome mix, shown by --hypothesis-show-statistics
        assert error.code() in ACCEPTABLE_CODES, (error.code(), error.details())
        return
    event("OK")
    assert responses and responses[-1].finish_reason in ("stop", "length")


def test_a_vanishing_temperature_is_greedy_and_keeps_the_verifier(grpc_router: RunningRouter) -> None:
    """Found by this fuzzing: temperature 1e-45 gave the verifier NaN probabilities, so the request failed INTERNAL
    there and the router took its only verifier out of rotation (UNAVAILABLE for everyone until a health check)."""
    with Client(grpc_router.grpc_address, timeout_s=CALL_TIMEOUT_S) as client:
        greedy = client.generate(prompt_ids=[0, 0], max_tokens=4, temperature=0.0, ignore_eos=True, speculation="off")
        for temperature in (1e-45, 1e-30):
            result = client.generate(
                prompt_ids=[0, 0], max_tokens=4, temperature=temperature, ignore_eos=True, speculation="off"
            )
            assert result.token_ids == greedy.token_ids
    assert all(worker.healthy for worker in grpc_router.frontend.workers())


def test_the_grpc_fuzzed_router_still_serves(grpc_router: RunningRouter) -> None:
    with Client(grpc_router.grpc_address, timeout_s=CALL_TIMEOUT_S) as client:
        result = client.generate(prompt_ids=[1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(result.token_ids) == 4 and result.finish_reason == "length"
    assert wait_until(lambda: all(worker.outstanding == 0 for worker in grpc_router.frontend.workers()))
