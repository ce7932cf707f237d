"""The OpenAI-compatible HTTP API: completions and chat, streaming (SSE) and not, stop strings, errors.

Fake workers behind real gRPC servers (see ``test_router_grpc``) with the real SmolLM2 tokenizer on the router:
the fake target's greedy continuation cycles through the tokens of a known sentence, so every expected text is
exact. Requests go over a real socket with ``http.client``.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from specdec.model_files import load_tokenizer
from tests.test_router_grpc import Stack, wait_until
from tests.tiny_models import SMOLLM2

SENTENCE = "Hello wörld 🎉, this is a test. STOP here and more text after the stop marker 日本."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def sentence_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return tokenizer.encode(SENTENCE, add_special_tokens=False)


@pytest.fixture(scope="module")
def stack(tokenizer: PreTrainedTokenizerBase, sentence_ids: list[int]) -> Iterator[Stack]:
    stack = Stack(
        tokenizer=tokenizer, next_token=lambda context: sentence_ids[len(context) % len(sentence_ids)], model=SMOLLM2
    )
    yield stack
    stack.stop()


def expected_ids(sentence_ids: list[int], prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    return [sentence_ids[(len(prompt_ids) + i) % len(sentence_ids)] for i in range(max_tokens)]


def request(
    address: str,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request (HTTPS with the client context ``tls``): status, headers and body."""
    host, port = address.rsplit(":", 1)
    connection = (
        http.client.HTTPSConnection(host, int(port), timeout=30, context=tls)
        if tls is not None
        else http.client.HTTPConnection(host, int(port), timeout=30)
    )
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def post(stack: Stack, path: str, body: Any, **kwargs) -> tuple[int, dict[str, str], Any]:
    status, headers, data = request(stack.router.http_address, "POST", path, body, **kwargs)
    if headers.get("Content-Type", "").startswith("text/event-stream"):
        return status, headers, data
    return status, headers, json.loads(data)


def events(data: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``."""
    payloads = []
    for block in data.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            payloads.append(payload if payload == "[DONE]" else json.loads(payload))
    return payloads


def test_completions(stack: Stack, tokenizer, sentence_ids) -> None:
    prompt_ids = tokenizer.encode("Say something", add_special_tokens=False)
    status, _, body = post(
        stack, "/v1/completions", {"model": SMOLLM2, "prompt": "Say something", "max_tokens": 20, "temperature": 0}
    )
    assert status == 200, body
    ids = expected_ids(sentence_ids, prompt_ids, 20)
    assert body["object"] == "text_completion" and body["model"] == SMOLLM2
    [choice] = body["choices"]
    assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 20,
        "total_tokens": len(prompt_ids) + 20,
    }
    assert body["speculation"]["rounds"] >= 1 and "mean_accepted_length" in body["speculation"]


def test_completions_default_max_tokens_is_16_and_ids_are_accepted(stack: Stack, tokenizer, sentence_ids) -> None:
    status, _, body = post(stack, "/v1/completions", {"prompt": [5, 6, 7], "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["text"] == tokenizer.decode(
        expected_ids(sentence_ids, [5, 6, 7], 16), skip_special_tokens=True
    )


def test_completions_streaming(stack: Stack, tokenizer, sentence_ids) -> None:
    body = {"prompt": "Say something", "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
    status, headers, data = post(stack, "/v1/completions", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    payloads = events(data)
    assert payloads[-1] == "[DONE]"
    chunks, usage = payloads[:-2], payloads[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
    assert all(chunk["object"] == "text_completion" for chunk in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    prompt_ids = tokenizer.encode("Say something", add_special_tokens=False)
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    assert text == tokenizer.decode(expected_ids(sentence_ids, prompt_ids, 30), skip_special_tokens=True)
    assert len(chunks) > 3, "text should arrive round by round"


def test_chat(stack: Stack, tokenizer, sentence_ids) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    expected = tokenizer.decode(expected_ids(sentence_ids, prompt_ids, 12), skip_special_tokens=True)
    status, _, body = post(stack, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 12})
    assert status == 200, body
    assert body["object"] == "chat.completion"
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": expected}
    assert choice["finish_reason"] == "length" and body["usage"]["prompt_tokens"] == len(prompt_ids)

    status, _, data = post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "stream": True})
    payloads = events(data)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(stack: Stack, tokenizer, sentence_ids, stream: bool) -> None:
    prompt_ids = [1, 2, 3]
    full = tokenizer.decode(expected_ids(sentence_ids, prompt_ids, 60), skip_special_tokens=True)
    cut = full.index("STOP")
    body = {"prompt": prompt_ids, "max_tokens": 60, "stop": ["nothing", "STOP"], "stream": stream}
    status, _, data = post(stack, "/v1/completions", body)
    assert status == 200
    if stream:
        chunks = events(data)[:-1]
        text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        text, finish = data["choices"][0]["text"], data["choices"][0]["finish_reason"]
        assert data["usage"]["completion_tokens"] < 60
    assert (text, finish) == (full[:cut], "stop")
    assert wait_until(lambda: not stack.verifier.sequences and not stack.drafter.sequences)


def test_models_and_health(stack: Stack) -> None:
    status, _, data = request(stack.router.http_address, "GET", "/v1/models")
    assert status == 200
    assert [model["id"] for model in json.loads(data)["data"]] == [SMOLLM2]
    status, _, data = request(stack.router.http_address, "GET", "/health")
    assert (status, json.loads(data)) == (200, {"status": "ok"})


BAD = {
    "no prompt": ("/v1/completions", {"max_tokens": 4}, "prompt"),
    "empty prompt": ("/v1/completions", {"prompt": "", "max_tokens": 4}, "prompt"),
    "max_tokens 0": ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    "max_tokens text": ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    "temperature": ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    "top_p": ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    "top_k": ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    "model": ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, "model"),
    "n": ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
    "batch": ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    "stream type": ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    "drafter": ("/v1/completions", {"prompt": "x", "drafter": "magic"}, "drafter"),
    "speculation": ("/v1/completions", {"prompt": "x", "speculation": "turbo"}, "speculation"),
    "stop type": ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    "no messages": ("/v1/chat/completions", {"messages": []}, "messages"),
    "bad message": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0]"),
    "bad content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    "not an object": ("/v1/completions", [1, 2], "body"),
    # numbers past what the internal wire carries (these were 500s)
    "max_tokens past int32": ("/v1/completions", {"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    "top_k past int32": ("/v1/completions", {"prompt": "x", "top_k": 2**40}, "top_k"),
    "token id past int32": ("/v1/completions", {"prompt": [2**40], "max_tokens": 2}, "prompt_ids"),
    "integer beyond float": ("/v1/completions", {"prompt": "x", "temperature": 10**400}, "temperature"),
    "temperature past float32": ("/v1/completions", {"prompt": "x", "temperature": 1e39}, "temperature"),
    "top_p rounds to 0": ("/v1/completions", {"prompt": "x", "top_p": 1e-50}, "top_p"),
    "seed past uint64": ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    # OpenAI parity
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    "top_logprobs 21": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    "top_logprobs without logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    "completions logprobs 21": ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    "completions logprobs negative": ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    "n 0": ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    "presence_penalty": ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    "logit_bias": ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    "response_format": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
        "response_format",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_request_is_400_naming_the_field(stack: Stack, case: str) -> None:
    path, body, field = BAD[case]
    status, _, answer = post(stack, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == field
    assert answer["error"]["message"].startswith(field)
    assert answer["error"]["type"] == "invalid_request_error"
    status, _, _ = post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 2})  # still serving
    assert status == 200


def test_malformed_json_and_utf8_are_400(stack: Stack) -> None:
    for data in (b"{not json", b'{"prompt": "\xff\xfe"}'):
        status, _, answer = post(stack, "/v1/completions", data)
        assert status == 400 and answer["error"]["param"] == "body"


RAW_BAD = {  # raw bodies; each was a 500, or (surrogates outside the prompt, nesting in an unknown field) let through
    "lone surrogate in the prompt": ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
    "lone surrogate in a stop string": ("/v1/completions", b'{"prompt": "ab", "stop": ["\\udc00"]}', "stop[0]"),
    "lone surrogate in a message": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}',
        "messages[0].content[0].text",
    ),
    "lone surrogate in a key": ("/v1/completions", b'{"prompt": "a", "\\ud800": 1}', "body"),
    "nested too deep": ("/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "body"),
    "nested past the decoder": ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    "integer past the digit limit": ("/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "body"),
}


@pytest.mark.parametrize("case", list(RAW_BAD))
def test_bodies_no_tokenizer_can_take_are_400_naming_the_field(stack: Stack, case: str) -> None:
    path, data, field = RAW_BAD[case]
    status, _, answer = post(stack, path, data)
    assert status == 400 and answer["error"]["param"] == field, answer
    assert post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200


def test_top_k_minus_one_is_disabled(stack: Stack) -> None:
    status, _, answer = post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 3, "top_k": -1})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3, answer


def test_chat_logprobs_layout(stack: Stack, tokenizer) -> None:
    """OpenAI's chat layout: per token its text, logprob, UTF-8 bytes and top_logprobs (the fake target's own token
    at -0.5), in the whole body and in the streamed chunks."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10, "logprobs": True, "top_logprobs": 1}
    status, _, answer = post(stack, "/v1/chat/completions", body)
    assert status == 200, answer
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == 10
    for entry in content:
        assert entry["logprob"] == -0.5 and entry["bytes"] == list(entry["token"].encode())
        assert entry["top_logprobs"] == [{"token": entry["token"], "logprob": -0.5, "bytes": entry["bytes"]}]
    status, _, data = post(stack, "/v1/chat/completions", {**body, "stream": True})
    streamed = [
        entry for chunk in events(data)[:-1] for entry in ((chunk["choices"][0]["logprobs"] or {}).get("content") or [])
    ]
    assert streamed == content
    status, _, answer = post(stack, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert status == 200 and answer["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(stack: Stack, tokenizer, sentence_ids, stream: bool) -> None:
    """``n = 3``: three choices, indexed, each a whole generation; usage counts the prompt once."""
    prompt_ids = [1, 2, 3]
    expected = tokenizer.decode(expected_ids(sentence_ids, prompt_ids, 8), skip_special_tokens=True)
    body = {"prompt": prompt_ids, "max_tokens": 8, "n": 3, "stream": stream, "stream_options": {"include_usage": True}}
    status, _, data = post(stack, "/v1/completions", body)
    assert status == 200
    if stream:
        payloads = events(data)
        assert payloads[-1] == "[DONE]"
        usage, chunks = payloads[-2]["usage"], payloads[:-2]
        texts, finishes = {}, {}
        for chunk in chunks:
            [choice] = chunk["choices"]
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
        assert texts == dict.fromkeys(range(3), expected) and finishes == dict.fromkeys(range(3), "length")
    else:
        usage = data["usage"]
        assert [(c["index"], c["text"], c["finish_reason"]) for c in data["choices"]] == [
            (index, expected, "length") for index in range(3)
        ]
        assert data["speculation"]["rounds"] >= 3
    assert usage == {"prompt_tokens": 3, "completion_tokens": 24, "total_tokens": 27}
    assert wait_until(lambda: not stack.verifier.sequences and not stack.drafter.sequences)


def test_overload_is_429_with_retry_after(tokenizer) -> None:
    stack = Stack(delay_s=0.05, tokenizer=tokenizer, model=SMOLLM2, max_concurrent_requests=1, retry_after_s=1.5)
    try:
        done = threading.Event()

        def long_request() -> None:
            post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 40, "speculation": "off", "ignore_eos": True})
            done.set()

        thread = threading.Thread(target=long_request)
        thread.start()
        assert wait_until(lambda: stack.verifier.sequences, 5)
        status, headers, answer = post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 429 and headers["Retry-After"] == "2"
        assert answer["error"]["type"] == "rate_limit_error"
        thread.join(timeout=20)
        assert done.is_set()
    finally:
        stack.stop()


def test_bearer_token_and_disconnect(tokenizer) -> None:
    """401 without the token (health stays open); a client that disconnects mid-stream frees both workers."""
    stack = Stack(delay_s=0.02, tokenizer=tokenizer, model=SMOLLM2, bearer_token="tok")
    try:
        status, _, answer = post(stack, "/v1/completions", {"prompt": "x"})
        assert status == 401 and answer["error"]["type"] == "authentication_error"
        assert request(stack.router.http_address, "GET", "/health")[0] == 200
        auth = {"Authorization": "Bearer tok"}
        assert post(stack, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers=auth)[0] == 200

        host, port = stack.router.http_address.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        body = json.dumps({"prompt": "x", "max_tokens": 5000, "stream": True, "ignore_eos": True, "speculation": "off"})
        connection.request("POST", "/v1/completions", body=body, headers={**auth, "Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first event has arrived
        assert stack.verifier.sequences
        connection.sock.close()
        connection.close()
        started = time.monotonic()
        assert wait_until(lambda: not stack.verifier.sequences and not stack.drafter.sequences, 3)
        assert time.monotonic() - started < 3
    finally:
        stack.stop()
