"""BatchVerifier: batched rounds equal rounds alone, the deferred bonus (DESIGN §4 pipelining) keeps the target's
law, bad calls are refused before anything changes, and every sequence's KV is freed."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from specdec.drafters.base import Proposal
from specdec.errors import CapacityError, InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.tree import TokenTree
from specdec.verification import BatchVerifier, PrefillChunk, SequenceNotFoundError, VerifyCall
from tests.exact_law import random_model
from tests.test_end_to_end_distribution import LENGTH, PROMPT, SAMPLES, VOCAB, assert_same_law, exact_law
from tests.tiny_models import tiny_llama

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams()
PROMPTS = [[1, 2, 3, 1, 2], [4], [5, 5, 5, 5, 5, 5, 5, 5], [0, 6, 3], [2, 4, 6, 2, 4, 6, 2]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=21, vocab_size=8, num_layers=2)


def hf_greedy(loaded: LoadedModel, prompt: list[int], count: int) -> list[int]:
    """Target-only greedy continuation by plain full Hugging Face forwards (no cache)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            ids.append(int(loaded.model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def hf_probs(loaded: LoadedModel, text: list[int], params: SamplingParams) -> torch.Tensor:
    """The target's processed p [V] after ``text``."""
    with torch.inference_mode():
        return logits_to_probs(loaded.model(torch.tensor([text])).logits[0, -1], params)


# --- greedy: arbitrary proposals, pipelined or not, batched or alone, give the target's own output -------------


class GreedyScript:
    """A seeded stream of proposals for one sequence around its true greedy continuation ``truth``.

    Chains or trees that follow ``truth`` for a random number of tokens, then go astray; empty proposals; with
    or without draft rows; ``defer_bonus`` at random. When the last round deferred its bonus, the next proposal
    is a chain that hangs off the last accepted token (the pipelined pre-draft) or empty.
    """

    def __init__(self, seed: int, truth: list[int], vocab: int) -> None:
        self.rng, self.truth, self.vocab = random.Random(seed), truth, vocab

    def call(self, sequence_id: str, done: int) -> VerifyCall:
        rng, ahead = self.rng, self.truth[done:]
        kind = rng.choice(["empty", "chain", "chain", "tree"])
        if kind == "empty" or not ahead:
            tree = TokenTree.empty()
        else:
            good = rng.randint(0, min(4, len(ahead)))
            tokens = ahead[:good] + [rng.randrange(self.vocab) for _ in range(rng.randint(0, 2))]
            tree = TokenTree.chain(tokens)
            if kind == "tree" and tokens:  # a sibling under every chain node, tried first
                nodes, parents = [], []
                for depth, token in enumerate(tokens):
                    parent = -1 if depth == 0 else len(nodes) - 1
                    nodes += [(token + 1) % self.vocab, token]
                    parents += [parent, parent]
                tree = TokenTree(tuple(nodes), tuple(parents))
        draft = None
        if len(tree) and rng.random() < 0.5:
            draft = torch.full((len(tree), self.vocab), 0.5 / (self.vocab - 1))
            draft[torch.arange(len(tree)), torch.tensor(tree.tokens)] = 0.5
        return VerifyCall(sequence_id, Proposal(tree, draft, "iid"), defer_bonus=rng.random() < 0.7)


def run_greedy(
    verifier: BatchVerifier, scripts: dict[str, GreedyScript], budget: int | None = None
) -> dict[str, tuple[list[int], int]]:
    """Drive every sequence to its end in batched rounds; returns (output, deferred rounds) per id.

    With ``budget``, a call over ``budget`` positions whose prompt has tokens to spare waits while up to
    ``budget`` of them are prefilled (a :class:`PrefillChunk` in the forward of the other sequences' calls).
    """
    outputs = {sequence_id: [] for sequence_id in scripts}
    deferred = Counter()
    active = list(scripts)
    waiting: dict[str, VerifyCall] = {}  # each sequence's next call, drawn once
    while active:
        for sid in active:
            if sid not in waiting:
                waiting[sid] = scripts[sid].call(sid, len(outputs[sid]))
        chunks = [
            PrefillChunk(sid, min(budget, verifier.prefillable(sid)))
            for sid, call in waiting.items()
            if budget is not None and verifier.forward_tokens(call) > budget and verifier.prefillable(sid)
        ]
        chunked = {chunk.sequence_id for chunk in chunks}
        calls = [call for sid, call in waiting.items() if sid not in chunked]
        for call, outcome in zip(calls, verifier.verify(calls, chunks), strict=True):
            del waiting[call.sequence_id]
            outputs[call.sequence_id] += outcome.verdict.emitted
            deferred[call.sequence_id] += outcome.bonus_deferred
            assert outcome.batch_size == len(calls)
            if outcome.bonus_deferred:
                assert outcome.verdict.emitted == [call.proposal.tree.tokens[n] for n in outcome.verdict.accepted_path]
                assert outcome.verdict.final_token_kind is None and not outcome.verdict.finished
            if outcome.finish_reason is not None:
                assert outcome.finish_reason == "length" and outcome.verdict.finished
                verifier.close(call.sequence_id)
                active.remove(call.sequence_id)
    return {sid: (outputs[sid], deferred[sid]) for sid in scripts}


def test_greedy_batched_equals_alone_equals_target(target) -> None:
    truths = [hf_greedy(target, prompt, MAX_TOKENS) for prompt in PROMPTS]

    def open_all(verifier: BatchVerifier, indices: list[int]) -> dict[str, GreedyScript]:
        for index in indices:
            verifier.open(f"s{index}", PROMPTS[index], GREEDY, None, MAX_TOKENS, frozenset(), ignore_eos=True)
        return {f"s{index}": GreedyScript(index, truths[index], target.vocab_size) for index in indices}

    batched = BatchVerifier(KVRunner(target.model))
    together = run_greedy(batched, open_all(batched, list(range(len(PROMPTS)))))
    assert batched.num_open == 0 and batched.runner.num_open == 0
    for index in range(len(PROMPTS)):
        alone_verifier = BatchVerifier(KVRunner(target.model))
        [alone] = run_greedy(alone_verifier, open_all(alone_verifier, [index])).values()
        assert together[f"s{index}"] == alone
        assert alone[0] == truths[index]
    assert sum(deferred for _, deferred in together.values()) >= 5, "the scripts should defer some bonuses"


LONG_PROMPTS = [
    [(3 * i + 1) % 7 for i in range(17)],
    [4, 0, 6, 2] * 3,
    [5],
    [2, 6, 1, 3],
    [i * i % 8 for i in range(9)],
]
BUDGET = 4


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95)], ids=str)
def test_chunked_prefill_changes_no_token(params: SamplingParams, target) -> None:
    """Prompts up to four times a budget of 4 prefilled 4 tokens at a time, in the forwards of the other sequences'
    calls, give the tokens their whole-prompt prefill gives: chunks consume no randomness and commit the KV the
    whole prompt would; greedy, both are the target's own continuation."""
    truths = [hf_greedy(target, prompt, MAX_TOKENS) for prompt in LONG_PROMPTS]

    def run(budget: int | None) -> dict[str, tuple[list[int], int]]:
        verifier = BatchVerifier(KVRunner(target.model))
        scripts = {}
        for index, prompt in enumerate(LONG_PROMPTS):
            verifier.open(f"s{index}", prompt, params, 50 + index, MAX_TOKENS, frozenset(), ignore_eos=True)
            scripts[f"s{index}"] = GreedyScript(index, truths[index], target.vocab_size)
        outputs = run_greedy(verifier, scripts, budget)
        assert verifier.num_open == 0 and verifier.runner.num_open == 0
        return outputs

    whole, chunked = run(None), run(BUDGET)
    assert chunked == whole
    if params.greedy:
        assert [whole[f"s{index}"][0] for index in range(len(LONG_PROMPTS))] == truths


def test_prefill_chunks_leave_the_last_prompt_token(target) -> None:
    """A chunk commits the head of the prompt; the last token waits for the verification, which needs its row;
    bad chunks are refused before anything changes."""
    prompt = LONG_PROMPTS[0]
    verifier = BatchVerifier(KVRunner(target.model))
    verifier.open("a", prompt, GREEDY, None, 4, frozenset(), ignore_eos=True)
    verifier.open("b", [4], GREEDY, None, 4, frozenset(), ignore_eos=True)
    empty = VerifyCall("a", Proposal(TokenTree.empty(), None))
    assert (verifier.prefillable("a"), verifier.prefillable("b"), verifier.prefillable("nope")) == (16, 0, 0)
    for chunk, error in [
        (PrefillChunk("a", 0), "num_tokens"),
        (PrefillChunk("a", len(prompt)), "num_tokens"),
        (PrefillChunk("b", 1), "num_tokens"),
    ]:
        with pytest.raises(InvalidArgumentError) as raised:
            verifier.verify([], [chunk])
        assert raised.value.field == error
    with pytest.raises(SequenceNotFoundError):
        verifier.verify([], [PrefillChunk("nope", 1)])
    with pytest.raises(InvalidArgumentError, match="twice"):
        verifier.verify([empty], [PrefillChunk("a", 1)])
    runner_seq = verifier._sequences["a"].runner_seq
    assert verifier.runner.length(runner_seq) == 0, "refused chunks change nothing"
    [outcome] = verifier.verify([VerifyCall("b", Proposal(TokenTree.empty(), None))], [PrefillChunk("a", 10)])
    assert outcome.batch_size == 1
    assert verifier.runner.length(runner_seq) == 10 and verifier.forward_tokens(empty) == 7
    assert verifier.verify([], [PrefillChunk("a", 6)]) == []
    assert verifier.prefillable("a") == 0 and verifier.forward_tokens(empty) == 1
    [outcome] = verifier.verify([empty])
    assert outcome.verdict.emitted == hf_greedy(target, prompt, 1)
    verifier.close("a")
    verifier.close("b")
    assert verifier.runner.num_open == 0


# --- the deferred bonus keeps the target's law ----------------------------------------------------------------

GAMMA = 2


class PipelinedDrafter:
    """A context-dependent toy draft ``q`` (float32 rows with zeros, from :func:`tests.exact_law.random_model`)
    drafting chains of GAMMA tokens, and pre-drafting the next chain as if the current one were accepted."""

    def __init__(self, seed: int) -> None:
        self.model = random_model(seed, VOCAB)
        self.rng = torch.Generator().manual_seed(seed)

    def chain(self, context: tuple[int, ...]) -> Proposal:
        tokens, rows = [], []
        for _ in range(GAMMA):
            row = torch.tensor([float(x) for x in self.model(context + tuple(tokens))], dtype=torch.float32)
            tokens.append(int(torch.multinomial(row, 1, generator=self.rng)))
            rows.append(row)
        return Proposal(TokenTree.chain(tokens), torch.stack(rows))


def pipelined_law(
    target: LoadedModel, params: SamplingParams, verifier_class: type[BatchVerifier] = BatchVerifier
) -> Counter:
    """SAMPLES sequences, each verified in pipelined rounds with ``defer_bonus``; counts of the first LENGTH tokens.

    After a deferred bonus the next call is the chain pre-drafted before the verdict was known (or, one time in
    four, an empty proposal: the bonus is drawn from the kept row); after any other verdict the pre-draft is
    thrown away and a fresh chain drafted from the committed text.
    """
    counts: Counter = Counter()
    drafter, choice = PipelinedDrafter(seed=3), random.Random(4)
    for start in range(0, SAMPLES, 1000):
        verifier = verifier_class(KVRunner(target.model))
        text: dict[str, list[int]] = {}
        pre_drafted: dict[str, Proposal | None] = {}
        for index in range(start, start + 1000):
            sid = str(index)
            verifier.open(sid, PROMPT, params, index, LENGTH + 3, frozenset(), ignore_eos=True)
            text[sid], pre_drafted[sid] = [], None
        active = list(text)
        while active:
            calls, next_drafts = [], {}
            for sid in active:
                if pre_drafted[sid] is not None:
                    proposal = pre_drafted[sid] if choice.random() < 0.75 else Proposal(TokenTree.empty(), None)
                else:
                    proposal = drafter.chain(tuple(text[sid]))
                calls.append(VerifyCall(sid, proposal, defer_bonus=True))
                # drafted while the verifier works, assuming the whole proposal is accepted
                next_drafts[sid] = drafter.chain(tuple(text[sid]) + proposal.tree.tokens)
            for call, outcome in zip(calls, verifier.verify(calls), strict=True):
                sid = call.sequence_id
                text[sid] += outcome.verdict.emitted
                pre_drafted[sid] = next_drafts[sid] if outcome.bonus_deferred else None
                if len(text[sid]) >= LENGTH:
                    counts[tuple(text[sid][:LENGTH])] += 1
                    verifier.close(sid)
                    active.remove(sid)
        assert verifier.runner.num_open == 0
    return counts


@pytest.fixture(scope="module")
def law_target() -> LoadedModel:
    return tiny_llama(seed=11, vocab_size=VOCAB, num_layers=2)


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.8, top_k=4, top_p=0.9)], ids=str)
def test_deferred_bonus_follows_the_target_law(params: SamplingParams, law_target) -> None:
    counts = pipelined_law(law_target, params)
    assert sum(counts.values()) == SAMPLES
    assert_same_law(counts, exact_law(law_target, params, stop_at_eos=False))


class OffByOneVerifier(BatchVerifier):
    """Negative control: keeps ``p(γ)`` (the row that verified the leaf) instead of ``p(γ+1)`` as the root row."""

    def _commit(self, job) -> None:
        super()._commit(job)
        if job.deferred:
            path = job.verdict.accepted_path
            job.sequence.root_row = job.rows[path[-2] + 1 if len(path) > 1 else 0]


def test_the_law_test_catches_a_wrong_root_row(law_target) -> None:
    counts = pipelined_law(law_target, SAMPLED, OffByOneVerifier)
    with pytest.raises(AssertionError, match=r"chi-square|impossible"):
        assert_same_law(counts, exact_law(law_target, SAMPLED, stop_at_eos=False))


def test_deferred_bonus_mechanics_and_logprobs(target) -> None:
    """Deferral emits the accepted chain only and keeps KV of all of it; the next call's root row is p(γ+1)."""
    prompt, params = PROMPTS[0], SamplingParams(temperature=0.7, top_k=5)
    verifier = BatchVerifier(KVRunner(target.model))
    verifier.open("a", prompt, params, 0, 10, target.eos_token_ids, ignore_eos=True, logprobs=True)
    p = hf_probs(target, prompt, params)
    chain = [int(p.argmax()), 3]
    text = prompt + chain[:1]
    chain[1] = int(hf_probs(target, text, params).argmax())
    draft = torch.zeros(2, 8)
    draft[0, chain[0]] = draft[1, chain[1]] = 1.0  # one-hot q at likely tokens: accepted with probability p(x)
    for seed in range(1, 200):  # find a seed where both are accepted (the verifier's stream is seeded per sequence)
        [outcome] = verifier.verify([VerifyCall("a", Proposal(TokenTree.chain(chain), draft), defer_bonus=True)])
        if outcome.bonus_deferred:
            break
        verifier.close("a")
        verifier.open("a", prompt, params, seed, 10, target.eos_token_ids, ignore_eos=True, logprobs=True)
    assert outcome.bonus_deferred and outcome.verdict.emitted == chain and outcome.verdict.accepted_path == [0, 1]
    expected = [math.log(hf_probs(target, prompt + chain[:i], params)[chain[i]]) for i in range(2)]
    assert outcome.logprobs == pytest.approx(expected, abs=1e-5)
    runner_seq = verifier._sequences["a"].runner_seq
    assert verifier.runner.length(runner_seq) == len(prompt) + 2  # the leaf has KV; nothing is pending
    kept = hf_probs(target, prompt + chain, params)
    # an empty proposal draws the bonus from the kept row, without a forward
    [bonus] = verifier.verify([VerifyCall("a", Proposal(TokenTree.empty(), None), defer_bonus=True)])
    assert not bonus.bonus_deferred and bonus.verdict.final_token_kind == "bonus" and len(bonus.verdict.emitted) == 1
    assert kept[bonus.verdict.emitted[0]] > 0
    assert bonus.logprobs == pytest.approx([math.log(kept[bonus.verdict.emitted[0]])], abs=1e-5)
    assert verifier.runner.length(runner_seq) == len(prompt) + 2
    verifier.close("a")
    assert verifier.runner.num_open == 0


def test_deferral_not_on_rejection_nor_for_the_last_token(target) -> None:
    verifier = BatchVerifier(KVRunner(target.model))
    truth = hf_greedy(target, PROMPTS[0], 4)
    verifier.open("a", PROMPTS[0], GREEDY, None, 4, frozenset(), ignore_eos=True)
    wrong = (truth[0] + 1) % 8
    [rejected] = verifier.verify([VerifyCall("a", Proposal(TokenTree.chain([wrong]), None), defer_bonus=True)])
    assert not rejected.bonus_deferred and rejected.verdict.emitted == truth[:1]
    chain = Proposal(TokenTree.chain(truth[1:3]), None)
    [last] = verifier.verify([VerifyCall("a", chain, defer_bonus=True)])  # the bonus is the 4th and last token
    assert not last.bonus_deferred and last.verdict.emitted == truth[1:4] and last.finish_reason == "length"
    assert verifier.runner.num_open == 0, "a finished sequence frees its KV at once"
    assert verifier.num_open == 1
    with pytest.raises(InvalidArgumentError, match="finished"):
        verifier.verify([VerifyCall("a", Proposal(TokenTree.empty(), None))])
    verifier.close("a")
    verifier.close("a")  # idempotent
    assert verifier.num_open == 0


@pytest.mark.parametrize(("assumed_path", "deferred"), [((0,), True), ((1,), False), ((), True)])
def test_a_tree_defers_its_bonus_only_on_the_assumed_path(target, assumed_path: tuple[int, ...], deferred) -> None:
    """Two leaves under the root, the first the target's token: its whole path is accepted, and the bonus is deferred
    only when the pre-draft hung off that leaf (or off any, as a chain's); after the other leaf's pre-draft the bonus
    is drawn at once, as the round after it could not use a kept row."""
    verifier = BatchVerifier(KVRunner(target.model))
    truth = hf_greedy(target, PROMPTS[0], 2)
    verifier.open("a", PROMPTS[0], GREEDY, None, 8, frozenset(), ignore_eos=True)
    tree = TokenTree((truth[0], (truth[0] + 1) % 8), (-1, -1))
    call = VerifyCall("a", Proposal(tree, None), defer_bonus=True, assumed_path=assumed_path)
    [outcome] = verifier.verify([call])
    assert outcome.verdict.accepted_path == [0]
    assert outcome.bonus_deferred is deferred
    assert outcome.verdict.emitted == (truth[:1] if deferred else truth)
    verifier.close("a")


# --- sampled: batching does not change the seeded output ------------------------------------------------------


def test_sampled_batched_equals_alone(target) -> None:
    """Same seeds, same empty proposals: one batch or one sequence at a time gives the same tokens."""
    params = SamplingParams(temperature=0.9, top_p=0.95)

    def run(indices: list[int]) -> dict[int, list[int]]:
        verifier = BatchVerifier(KVRunner(target.model))
        for index in indices:
            verifier.open(str(index), PROMPTS[index], params, 100 + index, 12, frozenset(), ignore_eos=True)
        out = {index: [] for index in indices}
        for _ in range(12):
            calls = [VerifyCall(str(index), Proposal(TokenTree.empty(), None)) for index in indices]
            for index, outcome in zip(indices, verifier.verify(calls), strict=True):
                out[index] += outcome.verdict.emitted
        return out

    together = run(list(range(len(PROMPTS))))
    for index in range(len(PROMPTS)):
        assert run([index]) == {index: together[index]}


# --- refusals and cleanup -------------------------------------------------------------------------------------


def test_open_refusals(target) -> None:
    verifier = BatchVerifier(KVRunner(target.model, max_seq_len=16), max_sequences=2)
    open_ = verifier.open
    cases = {
        "sequence_id": lambda: open_("", [1], SAMPLED, 0, 4, frozenset()),
        "prompt": lambda: open_("x", [], SAMPLED, 0, 4, frozenset()),
        "max_tokens": lambda: open_("x", [1], SAMPLED, 0, 0, frozenset()),
    }
    for field, call in cases.items():
        with pytest.raises(InvalidArgumentError) as raised:
            call()
        assert raised.value.field == field
    with pytest.raises(InvalidArgumentError, match="prompt"):
        open_("x", [8], SAMPLED, 0, 4, frozenset())
    with pytest.raises(InvalidArgumentError, match="context"):
        open_("x", [1] * 10, SAMPLED, 0, 7, frozenset())
    open_("x", [1], SAMPLED, 0, 4, frozenset())
    with pytest.raises(InvalidArgumentError, match="already open"):
        open_("x", [1], SAMPLED, 0, 4, frozenset())
    open_("y", [1], SAMPLED, 0, 4, frozenset())
    with pytest.raises(CapacityError):
        open_("z", [1], SAMPLED, 0, 4, frozenset())
    assert verifier.num_open == 2


def test_bad_calls_change_nothing(target) -> None:
    verifier = BatchVerifier(KVRunner(target.model, max_seq_len=16))
    verifier.open("a", [1, 2, 3], SAMPLED, 7, 8, frozenset(), ignore_eos=True)
    verifier.open("b", [4], SAMPLED, 8, 8, frozenset(), ignore_eos=True)
    uniform = torch.full((1, 8), 1 / 8)
    bad = {
        "proposal.tree.tokens": Proposal(TokenTree.chain([8]), None),
        "proposal.draft": Proposal(TokenTree.chain([1]), torch.full((2, 8), 1 / 8)),
        "proposal.draft.rows": Proposal(TokenTree.chain([1]), uniform * 2),
        "proposal.tree": Proposal(TokenTree.chain([1] * 14), None),  # 3 + 14 positions > 16
        "proposal.sibling_sampling": Proposal(TokenTree.chain([1]), None, "top-k"),
    }
    negative, zero_at_token = uniform.clone(), uniform.clone()
    negative[0, 0], zero_at_token[0, 1] = -0.1, 0.0
    zero_at_token[0, 2] += 1 / 8
    repeated = Proposal(TokenTree((2, 2), (-1, -1)), None, "without_replacement")
    cases = [(field, proposal) for field, proposal in bad.items()]
    cases += [("proposal.draft.rows", Proposal(TokenTree.chain([1]), negative))]
    for value in (float("nan"), float("inf")):
        broken = uniform.clone()
        broken[0, 5] = value
        cases += [("proposal.draft.rows", Proposal(TokenTree.chain([1]), broken))]
    cases += [("proposal.draft.rows", Proposal(TokenTree.chain([1]), zero_at_token))]
    cases += [("proposal.tree.tokens", repeated)]
    good = VerifyCall("b", Proposal(TokenTree.empty(), None))
    for field, proposal in cases:
        with pytest.raises(InvalidArgumentError) as raised:
            verifier.verify([good, VerifyCall("a", proposal)])
        assert raised.value.field == field
    with pytest.raises(SequenceNotFoundError, match="nope"):
        verifier.verify([good, VerifyCall("nope", Proposal(TokenTree.empty(), None))])
    with pytest.raises(InvalidArgumentError, match="twice"):
        verifier.verify([good, good])
    # nothing was consumed: the same seeds give what a fresh verifier gives
    fresh = BatchVerifier(KVRunner(target.model, max_seq_len=16))
    fresh.open("a", [1, 2, 3], SAMPLED, 7, 8, frozenset(), ignore_eos=True)
    fresh.open("b", [4], SAMPLED, 8, 8, frozenset(), ignore_eos=True)
    calls = [VerifyCall("a", Proposal(TokenTree.chain([1, 2]), None)), good]
    assert [o.verdict for o in verifier.verify(calls)] == [o.verdict for o in fresh.verify(calls)]


def test_close_frees_runner_state(target) -> None:
    verifier = BatchVerifier(KVRunner(target.model))
    for index in range(6):
        verifier.open(str(index), PROMPTS[index % len(PROMPTS)], SAMPLED, index, 1 + index, frozenset())
    assert verifier.runner.num_open == 6
    live = [str(index) for index in range(6)]
    for _ in range(2):
        outcomes = verifier.verify([VerifyCall(sid, Proposal(TokenTree.chain([1, 2]), None)) for sid in live])
        assert all(o.verify_s > 0 and o.commit_s >= 0 for o in outcomes)
        live = [sid for sid, outcome in zip(live, outcomes, strict=True) if outcome.finish_reason is None]
    assert verifier.runner.num_open < 6, "finished sequences free their KV before close"
    for index in range(6):
        verifier.close(str(index))
    assert verifier.num_open == 0 and verifier.runner.num_open == 0
    with pytest.raises(SequenceNotFoundError):
        verifier.verify([VerifyCall("0", Proposal(TokenTree.empty(), None))])
