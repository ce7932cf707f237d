"""The whole stack on the real SmolLM2-135M: router (gRPC + OpenAI HTTP) over a verifier service and n-gram,
early-exit and eagle drafter services (a fused EAGLE-3 head trained briefly on the expected outputs, so it accepts
often and the three layers' feature rows really travel verifier -> router -> drafter; the co-located greedy test
covers the final-norm kind). Greedy chat output through the router, as token ids
and as text, streamed or not, equals the co-located Engine's target-only output for the same chat-templated prompt
(DESIGN §3). The early-exit drafter pre-drafts for three outcomes (multi-outcome pre-drafting); the eagle drafter
for one, pipelining trees too; every pipelined miss cancels its pre-draft."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from drafter_service.config import DrafterConfig
from drafter_service.server import start_drafter
from router.config import RouterConfig
from router.server import start_router
from specdec.cli import encode_prompt
from specdec.client import Client
from specdec.drafters.eagle_head import eagle3_layers
from specdec.engine import Engine, GenerationRequest
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from tests.controllers import CyclingController
from tests.eagle_heads import memorised_head
from tests.test_router_http import events, request
from tests.tiny_models import SMOLLM2, smollm2
from verifier_service.config import VerifierConfig
from verifier_service.server import start_verifier

pytestmark = pytest.mark.slow

MAX_TOKENS = 40
FUSED_LAYERS = eagle3_layers(30)  # SmolLM2-135M's low, middle and high layers
PROMPTS = {
    "repeat": "Repeat exactly: The quick brown fox jumps over the lazy dog. " * 2,
    "list": "List five fruits, one per line, numbered.",
}


class Stack:
    def __init__(self, target: LoadedModel, eagle_head: Path) -> None:
        self.verifier = start_verifier(VerifierConfig(), model=target)
        self.ngram = start_drafter(DrafterConfig(kind="ngram"), target=target)
        self.early = start_drafter(
            DrafterConfig(kind="early-exit", early_exit_layers=8, predraft_outcomes=3), target=target
        )
        self.eagle = start_drafter(DrafterConfig(kind="eagle", draft_model=str(eagle_head)), target=target)
        config = RouterConfig(
            model=SMOLLM2,
            tokenizer=SMOLLM2,
            verifiers=(self.verifier.address,),
            drafters=(self.ngram.address, self.early.address, self.eagle.address),
            grpc_port=0,
            http_port=0,
            shutdown_grace_s=0.5,
            # a 135M-parameter drafter sharing two busy cores with the verifier (and other tests) can take longer
            # than the default 5 s per call; these cases assert that no request falls back to target-only
            drafter_deadline_s=60.0,
        )
        # auto requests (the HTTP cases: the server default) change γ every round, 0 included
        self.router = start_router(config, tokenizer=target.tokenizer, controller=CyclingController())

    def stop(self) -> None:
        self.router.stop(0.5)
        for service in (self.verifier, self.ngram, self.early, self.eagle):
            service.stop(0)


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return smollm2()


@pytest.fixture(scope="module")
def stack(target: LoadedModel, expected, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    texts = [(encode_prompt(target, text, chat=True), expected[name]) for name, text in PROMPTS.items()]
    head = memorised_head(target, texts, tmp_path_factory.mktemp("eagle-head"), feature_layers=FUSED_LAYERS)
    stack = Stack(target, head)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def expected(target: LoadedModel) -> dict[str, list[int]]:
    """Co-located target-only greedy decoding of each chat-templated prompt."""
    engine = Engine(KVRunner(target.model), target.eos_token_ids, None)
    outputs = {}
    for name, text in PROMPTS.items():
        prompt = encode_prompt(target, text, chat=True)
        [result] = engine.generate([GenerationRequest(prompt, SamplingParams(temperature=0.0), MAX_TOKENS)])
        outputs[name] = result.token_ids
    return outputs


@pytest.mark.parametrize(
    ("drafter", "speculation", "gamma", "width"),
    [
        ("ngram", "pipelined", 4, 1),
        ("early-exit", "sequential", 2, 1),
        ("eagle", "sequential", 4, 1),
        ("eagle", "pipelined", 4, 1),
        ("eagle", "sequential", 3, 2),
        ("eagle", "pipelined", 3, 2),
        ("early-exit", "pipelined", 2, 1),
        ("eagle", "auto", 4, 1),
        ("eagle", "auto", 3, 2),
    ],
    ids=[
        "ngram-pipelined",
        "early-exit",
        "eagle-chain",
        "eagle-chain-pipelined",
        "eagle-tree",
        "eagle-tree-pipelined",
        "early-exit-multi-outcome",
        "eagle-auto",
        "eagle-tree-auto",
    ],
)
def test_grpc_chat_equals_colocated(
    stack: Stack, target, expected, drafter: str, speculation: str, gamma: int, width: int
) -> None:
    cancelled = stack.early.scheduler.status().result(10).cancelled
    with Client(stack.router.grpc_address, timeout_s=120) as client:
        for name, text in PROMPTS.items():
            result = client.generate(
                text,
                chat=True,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                drafter=drafter,
                speculation=speculation,
                num_draft_tokens=gamma,
                tree_width=width,
            )
            assert result.token_ids == expected[name], name
            assert result.text == target.tokenizer.decode(expected[name], skip_special_tokens=True)
            assert result.stats.draft_tokens > 0 and not result.stats.drafter_fallback
            if drafter == "eagle":  # accepted drafts, and the features that made them, crossed the wire
                assert result.stats.accepted_tokens >= 0.3 * result.stats.draft_tokens, result.stats
                assert result.stats.feature_bytes > 0
            if speculation == "pipelined":
                assert result.stats.pipeline_hits + result.stats.pipeline_misses > 0
            if speculation == "auto" and width > 1:  # the cycling controller cut the greedy tree to several sizes
                assert sum(count > 0 for count in result.stats.rounds_per_draft_size[1:]) >= 2, result.stats
    if drafter == "early-exit" and speculation == "pipelined":  # its pre-drafts outlast a verify: misses cancel them
        assert stack.early.scheduler.status().result(10).cancelled > cancelled


@pytest.mark.parametrize("stream", [False, True])
def test_http_chat_equals_colocated(stack: Stack, target, expected, stream: bool) -> None:
    for name, text in PROMPTS.items():
        body = {
            "model": SMOLLM2,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": stream,
            "drafter": "ngram",
        }
        status, _, data = request(stack.router.http_address, "POST", "/v1/chat/completions", body)
        assert status == 200, data
        if stream:
            chunks = events(data)[:-1]
            content = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            answer = json.loads(data)
            content, finish = answer["choices"][0]["message"]["content"], answer["choices"][0]["finish_reason"]
            assert answer["usage"]["completion_tokens"] == len(expected[name])
        assert content == target.tokenizer.decode(expected[name], skip_special_tokens=True), name
        assert finish == ("stop" if expected[name][-1] in target.eos_token_ids else "length")
