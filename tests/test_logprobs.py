"""``logprobs`` / ``top_logprobs``: the emitted token's log-probability and the most probable alternatives of its row
are exactly those of the target's processed ``p`` (the row the acceptance rule read), in the verifier, the co-located
engine and through the whole served stack (gRPC SDK and OpenAI HTTP), speculation on or off, pipelined (deferred
bonus rows) or not. Also here, on the same real stack: HTTP ``n > 1`` runs independent choices seeded ``seed + i``.

Reference: the tiny target run from scratch on the committed text, through :func:`~specdec.sampling.logits_to_probs`
(sampled) or a plain log-softmax of the logits (greedy, where the processed ``p`` is one-hot). Token ids must
match exactly, log-probabilities to float32 precision (the verifier's KV-cached forward is not bit-identical to a
fresh one).
"""

from __future__ import annotations

import http.client
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from drafter_service.config import DrafterConfig
from router.server import RunningRouter
from specdec.client import Client
from specdec.drafters import DraftConfig, build_drafter
from specdec.drafters.base import Proposal
from specdec.engine import Engine, GenerationRequest
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.sampling_params import MAX_TOP_LOGPROBS
from specdec.tree import TokenTree
from specdec.verification import BatchVerifier, VerifyCall
from tests.test_router_distribution import served_router
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2]
# top-k 5 of 8, then top-p: some rows keep fewer than 5 tokens, so "fewer alternatives than asked" is exercised
FILTERED = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
GREEDY = SamplingParams(temperature=0.0)
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=31, vocab_size=VOCAB, num_layers=2)


def reference_logprobs(target: LoadedModel, text: list[int], params: SamplingParams) -> torch.Tensor:
    """log p [V] of the next token after ``text``: processed p, or the raw log-softmax under greedy."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([text])).logits[0, -1].double()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    return torch.log(logits_to_probs(logits, params).double())


def assert_matches_target(
    target: LoadedModel,
    prompt: list[int],
    emitted: list[int],
    logprobs: list[float],
    alternatives: list[list[tuple[int, float]]],
    params: SamplingParams,
    count: int,
) -> None:
    """Each emitted token's logprob and its ``count`` alternatives are the target's, at the text before it."""
    assert len(logprobs) == len(alternatives) == len(emitted)
    for index, token in enumerate(emitted):
        log_p = reference_logprobs(target, prompt + emitted[:index], params)
        assert logprobs[index] == pytest.approx(float(log_p[token]), abs=TOLERANCE)
        support = [t for t in sorted(range(VOCAB), key=lambda t: (-float(log_p[t]), t)) if log_p[t] > -float("inf")]
        expected = support[:count]
        assert [t for t, _ in alternatives[index]] == expected, (index, alternatives[index], log_p)
        assert [lp for _, lp in alternatives[index]] == pytest.approx(
            [float(log_p[t]) for t in expected], abs=TOLERANCE
        )


# --- the verifier ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [FILTERED, GREEDY], ids=["sampled", "greedy"])
def test_the_verifier_returns_the_rows_the_rule_read(target: LoadedModel, params: SamplingParams) -> None:
    """Chains of random one-hot proposals with deferred bonuses: accepted, recovered, bonus and kept-row tokens."""
    verifier = BatchVerifier(KVRunner(target.model, max_seq_len=64))
    verifier.open(
        "s", PROMPT, params, 5, 30, frozenset(), ignore_eos=True, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS
    )
    chooser = random.Random(3)
    emitted: list[int] = []
    logprobs: list[float] = []
    alternatives: list[list[tuple[int, float]]] = []
    deferred = False
    while len(emitted) < 30:
        size = 0 if deferred else min(chooser.randint(0, 3), 30 - len(emitted) - 1)
        chain = [chooser.randrange(VOCAB) for _ in range(size)]
        [outcome] = verifier.verify([VerifyCall("s", Proposal(TokenTree.chain(chain), None), defer_bonus=True)])
        emitted += outcome.verdict.emitted
        logprobs += outcome.logprobs
        alternatives += [list(zip(top.token_ids, top.logprobs, strict=True)) for top in outcome.top_logprobs]
        deferred = outcome.bonus_deferred
    verifier.close("s")
    assert_matches_target(target, PROMPT, emitted, logprobs, alternatives, params, MAX_TOP_LOGPROBS)


def test_alternatives_are_computed_only_when_asked(target: LoadedModel) -> None:
    verifier = BatchVerifier(KVRunner(target.model, max_seq_len=64))
    verifier.open("plain", PROMPT, FILTERED, 5, 4, frozenset(), ignore_eos=True)
    verifier.open("logprobs", PROMPT, FILTERED, 5, 4, frozenset(), ignore_eos=True, logprobs=True)
    empty = Proposal(TokenTree.empty(), None)
    plain, only_logprobs = verifier.verify([VerifyCall("plain", empty), VerifyCall("logprobs", empty)])
    assert (plain.logprobs, plain.top_logprobs) == (None, None)
    assert len(only_logprobs.logprobs) == 1 and only_logprobs.top_logprobs is None


@pytest.mark.parametrize(
    ("top_logprobs", "logprobs"),
    [(-1, True), (MAX_TOP_LOGPROBS + 1, True), (3, False)],
    ids=["negative", "21", "alone"],
)
def test_the_verifier_refuses_bad_top_logprobs(target: LoadedModel, top_logprobs: int, logprobs: bool) -> None:
    verifier = BatchVerifier(KVRunner(target.model, max_seq_len=64))
    with pytest.raises(InvalidArgumentError) as raised:
        verifier.open("s", PROMPT, FILTERED, 5, 4, frozenset(), logprobs=logprobs, top_logprobs=top_logprobs)
    assert raised.value.field == "top_logprobs" and verifier.num_open == 0


@pytest.mark.parametrize("params", [FILTERED, GREEDY], ids=["sampled", "greedy"])
def test_the_co_located_engine_returns_them_too(target: LoadedModel, params: SamplingParams) -> None:
    draft = tiny_draft(target, seed=32, num_layers=1, noise=0.3)
    drafter = build_drafter("model", target, DraftConfig(num_draft_tokens=3), draft_model=draft)
    engine = Engine(KVRunner(target.model, max_seq_len=64), target.eos_token_ids, drafter)
    request = GenerationRequest(PROMPT, params, 20, seed=9, ignore_eos=True, logprobs=True, top_logprobs=3)
    [result] = engine.generate([request])
    assert result.stats.accepted_tokens > 0
    alternatives = [list(zip(top.token_ids, top.logprobs, strict=True)) for top in result.top_logprobs]
    assert_matches_target(target, PROMPT, result.token_ids, result.logprobs, alternatives, params, 3)


# --- the served stack --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def router(target: LoadedModel) -> Iterator[RunningRouter]:
    draft = tiny_draft(target, seed=32, num_layers=1, noise=0.3)
    with served_router(target, DrafterConfig(kind="model", draft_model=draft.name), draft=draft) as running:
        yield running


def post_completion(router: RunningRouter, body: dict) -> tuple[int, Any]:
    """Status and JSON answer; for ``"stream": true`` the list of the events' JSON payloads (``[DONE]`` dropped)."""
    host, port = router.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request(
            "POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        data = response.read()
    finally:
        connection.close()
    if not body.get("stream"):
        return response.status, json.loads(data)
    return response.status, [json.loads(event[len("data: ") :]) for event in data.decode().split("\n\n")[:-2]]


@pytest.mark.parametrize(
    ("speculation", "tree_width"), [("off", 1), ("sequential", 1), ("pipelined", 1), ("sequential", 2)]
)
@pytest.mark.parametrize("params", [FILTERED, GREEDY], ids=["sampled", "greedy"])
def test_the_sdk_gets_the_target_rows(
    router: RunningRouter, target: LoadedModel, params: SamplingParams, speculation: str, tree_width: int
) -> None:
    """Target-only, chains (pipelined: rows kept from a deferred bonus) and trees (rows of the chosen path)."""
    with Client(router.grpc_address, timeout_s=60) as client:
        result = client.generate(
            prompt_ids=PROMPT,
            max_tokens=16,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=11,
            ignore_eos=True,
            speculation=speculation,
            drafter="model",
            tree_width=tree_width,
            logprobs=True,
            top_logprobs=4,
        )
    if speculation != "off":
        assert result.stats.draft_tokens > 0
    assert_matches_target(target, PROMPT, result.token_ids, result.logprobs, result.top_logprobs, params, 4)


def test_http_completions_carry_the_target_rows(router: RunningRouter, target: LoadedModel) -> None:
    """``logprobs: N`` on completions: vLLM's layout, each top_logprobs dict the emitted token plus the top N."""
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": FILTERED.temperature,
        "top_k": FILTERED.top_k,
        "top_p": FILTERED.top_p,
        "seed": 4,
        "ignore_eos": True,
        "speculation": "pipelined",
        "logprobs": 3,
    }
    status, answer = post_completion(router, body)
    assert status == 200, answer
    logprobs = answer["choices"][0]["logprobs"]
    emitted = [int(token) for token in logprobs["tokens"]]  # no tokenizer on this router: a token's text is its id
    assert len(emitted) == 12 and logprobs["text_offset"] == [sum(map(len, logprobs["tokens"][:i])) for i in range(12)]
    for index, (token, top) in enumerate(zip(emitted, logprobs["top_logprobs"], strict=True)):
        log_p = reference_logprobs(target, PROMPT + emitted[:index], FILTERED)
        assert logprobs["token_logprobs"][index] == pytest.approx(float(log_p[token]), abs=TOLERANCE)
        assert next(iter(top)) == str(token)  # the emitted token first, then the top 3 (it may be among them)
        best = sorted((t for t in range(VOCAB) if log_p[t] > -float("inf")), key=lambda t: (-float(log_p[t]), t))[:3]
        assert set(top) == {str(t) for t in [token, *best]}
        assert all(logprob == pytest.approx(float(log_p[int(t)]), abs=TOLERANCE) for t, logprob in top.items())
    status, events = post_completion(router, {**body, "stream": True})  # the same seed: the same tokens, in chunks
    assert status == 200
    streamed = [event["choices"][0]["logprobs"] for event in events if event["choices"][0]["logprobs"]]
    assert len(streamed) > 1
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [entry for chunk in streamed for entry in chunk[key]] == logprobs[key]  # offsets run on across chunks


def test_n_choices_are_the_requests_seeded_seed_plus_i(router: RunningRouter) -> None:
    """Choice i of a seeded ``n = 4`` request is exactly the ``n = 1`` request with seed ``seed + i`` (target-only,
    where a seed fixes the output), and the choices differ."""
    body = {"prompt": PROMPT, "max_tokens": 8, "seed": 100, "ignore_eos": True, "speculation": "off", "logprobs": 0}
    status, answer = post_completion(router, {**body, "n": 4})
    assert status == 200, answer
    choices = [choice["logprobs"]["tokens"] for choice in answer["choices"]]
    singles = [post_completion(router, {**body, "seed": 100 + index})[1] for index in range(4)]
    assert choices == [single["choices"][0]["logprobs"]["tokens"] for single in singles]
    assert len({tuple(tokens) for tokens in choices}) > 1
    assert answer["usage"]["completion_tokens"] == 32
