"""Drafter pipelining and rollback (DESIGN §4): ``assume_accepted``, ``sync`` and ``commit`` on every drafter.

The invariant: after any of them a drafter proposes exactly what a drafter opened fresh on the same text
proposes. Greedy proposals must be identical; sampled ones (same seed, untruncated ``q``) must draw the same
tokens from ``q`` rows equal to 1e-5, which also proves the draft model's KV cache follows the text. Model
drafters must reuse the KV of accepted nodes (pointer arithmetic, no recomputation) and never leak runner
sequences.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from unittest import mock

import pytest
import torch

from specdec.drafters import DraftConfig, ModelDrafter, NgramDrafter, build_drafter
from specdec.drafters.base import SequenceDrafter, match_path, most_probable_leaf_path
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 16
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=1.0)
PROMPT = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
CHAIN = DraftConfig(num_draft_tokens=4, draft_top_k=0)
TREE = DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=7, draft_top_k=0)
IID_TREE = DraftConfig(num_draft_tokens=3, tree_width=2, tree_budget=7, draft_top_k=0, tree_sampling="iid")

# name -> (drafter kind, config)
DRAFTERS = {
    "ngram": ("ngram", CHAIN),
    "model-chain": ("model", CHAIN),
    "model-tree": ("model", TREE),
    "model-iid-tree": ("model", IID_TREE),
    "early-exit-chain": ("early-exit", CHAIN),
    "early-exit-tree": ("early-exit", TREE),
}
MODEL_DRAFTERS = [name for name, (kind, _) in DRAFTERS.items() if kind != "ngram"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=41, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_draft(target, seed=42, num_layers=1, noise=0.2)


@pytest.fixture
def make(target: LoadedModel, draft: LoadedModel) -> Callable[[str], SequenceDrafter]:
    def build(name: str) -> SequenceDrafter:
        kind, config = DRAFTERS[name]
        return build_drafter(kind, target, config, draft_model=draft, early_exit_layers=1)

    return build


def fresh_proposal(drafter: SequenceDrafter, text: list[int], params: SamplingParams, seed: int, budget: int):
    """What a drafter opened fresh on ``text`` proposes first (the handle is closed again)."""
    handle = drafter.open(text, params, torch.Generator().manual_seed(seed))
    try:
        [proposal] = drafter.propose([handle], [budget])
    finally:
        drafter.close(handle)
    return proposal


def assert_same_proposal(got, expected) -> None:
    assert got.tree == expected.tree
    assert got.scheme == expected.scheme
    if expected.draft_probs is None:
        assert got.draft_probs is None
    else:
        torch.testing.assert_close(got.draft_probs, expected.draft_probs, atol=1e-5, rtol=0)


def random_path(rng: random.Random, tree: TokenTree) -> list[int]:
    """A random root-to-node path (possibly empty) of ``tree``."""
    path: list[int] = []
    while children := tree.children(path[-1] if path else -1):
        if rng.random() < 0.25:
            break
        path.append(rng.choice(children))
    return path


def random_move(
    rng: random.Random, drafter: SequenceDrafter, handle: int, text: list[int], tree: TokenTree | None
) -> tuple[list[int], TokenTree | None]:
    """Apply one random text move (commit, assume or sync); return the text and outstanding tree it must leave."""
    choice = rng.random()
    if tree is not None and choice < 0.2:  # the engine's commit: a path, then a final token (or none: EOS)
        path = random_path(rng, tree)
        emitted = [tree.tokens[node] for node in path] + ([rng.randrange(VOCAB)] if rng.random() < 0.8 else [])
        drafter.commit(handle, path, emitted)
        return text + emitted, None
    if tree is not None and choice < 0.4:  # pipelining: the assumed path goes onto the text
        drafter.assume_accepted(handle)
        new = drafter.text(handle)
        assert new[: len(text)] == text
        if len(tree):
            path = match_path(tree, new[len(text) :])
            assert len(path) == len(new) - len(text) and not tree.children(path[-1]), "not a root-to-leaf path"
        return new, None
    base = rng.randint(max(1, len(text) - 8), len(text)) if len(text) < 60 else rng.randint(1, 20)
    kind = rng.choice(["confirm", "reject", "bonus", "verdict"])
    if kind == "confirm":  # an assumed chain confirmed (bonus deferred): nothing changes
        emitted = text[base:]
    elif kind == "reject":  # rolls back whatever was assumed after the correction
        emitted = [*text[base : rng.randint(base, len(text))], rng.randrange(VOCAB)]
    elif kind == "bonus":
        emitted = [*text[base:], rng.randrange(VOCAB)]
    else:  # the verdict of the outstanding tree, told through sync
        base = len(text)
        emitted = [tree.tokens[node] for node in random_path(rng, tree)] if tree is not None else []
        emitted.append(rng.randrange(VOCAB))
    drafter.sync(handle, base, emitted)
    new = text[:base] + emitted
    return new, tree if new == text else None


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_state_after_any_move_equals_a_fresh_open(name: str, params: SamplingParams, make) -> None:
    """Random walks of propose / commit / assume / sync; every proposal equals a fresh drafter's on the text."""
    rng = random.Random(f"{name}-{params.temperature}")
    drafter, reference = make(name), make(name)
    generator = torch.Generator()
    handle = drafter.open(PROMPT, params, generator)
    text, tree, proposals, drafted = list(PROMPT), None, 0, 0
    for step in range(80):
        if tree is None or rng.random() < 0.45:
            budget = rng.choice([0, 1, 3, 6, 6, 6])
            generator.manual_seed(step)
            [got] = drafter.propose([handle], [budget])
            assert_same_proposal(got, fresh_proposal(reference, text, params, step, budget))
            tree, proposals, drafted = got.tree, proposals + 1, drafted + len(got.tree)
        else:
            text, tree = random_move(rng, drafter, handle, text, tree)
        assert drafter.text(handle) == text
        if isinstance(drafter, ModelDrafter):
            assert drafter.cached_length(handle) <= len(text) - 1
            assert drafter.runner_sequences == drafter.num_open == 1
    assert proposals > 20 and drafted > 20, "the walk proposed too little to test anything"
    drafter.close(handle)
    assert drafter.num_open == reference.num_open == 0
    assert drafter.runner_sequences == reference.runner_sequences == 0


# --- the three moves, step by step (model drafters: what is reused, what is recomputed) ----------------------


def counting(drafter: ModelDrafter) -> dict[str, mock.MagicMock]:
    """Spies on the runner calls that compute or move KV."""
    return {
        method: mock.patch.object(drafter.runner, method, wraps=getattr(drafter.runner, method)).start()
        for method in ("forward", "commit", "truncate")
    }


@pytest.fixture(autouse=True)
def _stop_spies():
    yield
    mock.patch.stopall()


def pipelined_round(drafter: ModelDrafter, params: SamplingParams = GREEDY) -> tuple[int, list[int], TokenTree]:
    """Open, propose chain k, assume it, propose chain k+1; returns the handle, chain k's tokens and chain k+1."""
    handle = drafter.open(PROMPT, params, torch.Generator().manual_seed(0))
    [first] = drafter.propose([handle], [8])
    drafter.assume_accepted(handle)
    [second] = drafter.propose([handle], [8])
    assert len(first.tree) == len(second.tree) == 4 and first.tree.is_chain
    assert drafter.text(handle) == PROMPT + list(first.tree.tokens)
    return handle, list(first.tree.tokens), second.tree


@pytest.mark.parametrize("name", ["model-chain", "early-exit-chain"])
def test_assume_commits_the_forwarded_chain_and_drafts_on_top(name: str, make) -> None:
    drafter = make(name)
    handle = drafter.open(PROMPT, GREEDY, torch.Generator())
    [proposal] = drafter.propose([handle], [8])
    spies = counting(drafter)
    drafter.assume_accepted(handle)
    assert spies["forward"].call_count == 0, "assuming must not recompute anything"
    # nodes 0..2 went through the last forward; node 3 is the next pending input
    assert drafter.cached_length(handle) == len(PROMPT) + 3
    assert drafter.text(handle) == PROMPT + list(proposal.tree.tokens)


@pytest.mark.parametrize("name", ["model-chain", "early-exit-chain"])
def test_confirming_an_assumed_chain_does_no_work(name: str, make) -> None:
    drafter = make(name)
    handle, chain, second = pipelined_round(drafter)
    text, cached = drafter.text(handle), drafter.cached_length(handle)
    spies = counting(drafter)
    drafter.sync(handle, len(PROMPT), chain)  # all of chain k accepted, bonus deferred
    assert all(spy.call_count == 0 for spy in spies.values())
    assert drafter.text(handle) == text and drafter.cached_length(handle) == cached
    # chain k+1 is still outstanding: its verdict commits its forwarded KV
    drafter.sync(handle, len(text), [*list(second.tokens), 0])
    assert spies["forward"].call_count == 0 and spies["truncate"].call_count == 0
    assert drafter.cached_length(handle) == len(text) + 3  # node 3 and the bonus are pending
    assert_same_proposal(
        drafter.propose([handle], [8])[0], fresh_proposal(make(name), drafter.text(handle), GREEDY, 0, 8)
    )


@pytest.mark.parametrize("name", ["model-chain", "early-exit-chain"])
def test_rollback_after_a_rejection_is_pointer_arithmetic(name: str, make) -> None:
    drafter = make(name)
    handle, chain, _ = pipelined_round(drafter)
    spies = counting(drafter)
    correction = (chain[1] + 1) % VOCAB
    drafter.sync(handle, len(PROMPT), [chain[0], correction])  # chain[1] rejected: chain k+1 is discarded
    assert spies["forward"].call_count == 0 and spies["commit"].call_count == 0
    assert spies["truncate"].call_args_list == [mock.call(mock.ANY, len(PROMPT) + 1)]
    assert drafter.text(handle) == [*PROMPT, chain[0], correction]
    assert drafter.cached_length(handle) == len(PROMPT) + 1  # the correction is the next pending input
    with pytest.raises(InvalidArgumentError, match="assume_previous_accepted"):
        drafter.assume_accepted(handle)  # the discarded chain cannot be assumed
    text = drafter.text(handle)
    assert_same_proposal(drafter.propose([handle], [8])[0], fresh_proposal(make(name), text, GREEDY, 0, 8))


@pytest.mark.parametrize("name", ["model-chain", "early-exit-chain"])
def test_a_bonus_that_matches_the_predrafted_chain_keeps_its_kv(name: str, make) -> None:
    drafter = make(name)
    handle, chain, second = pipelined_round(drafter)
    spies = counting(drafter)
    drafter.sync(handle, len(PROMPT), [*chain, second.tokens[0]])  # all accepted, bonus = chain k+1's first token
    assert spies["forward"].call_count == 0
    text = drafter.text(handle)
    assert text == PROMPT + chain + [second.tokens[0]]
    assert drafter.cached_length(handle) == len(text) - 1  # everything but the last token is in the cache


@pytest.mark.parametrize("name", ["model-chain", "model-tree", "model-iid-tree", "early-exit-tree"])
def test_commit_keeps_the_forwarded_nodes_of_the_accepted_path(name: str, make) -> None:
    drafter = make(name)
    generator = torch.Generator().manual_seed(3)
    handle = drafter.open(PROMPT, SAMPLED, generator)
    [proposal] = drafter.propose([handle], [8])
    tree = proposal.tree
    deepest = max(range(len(tree)), key=lambda node: len(tree.path_to(node)))
    path = tree.path_to(deepest)
    assert len(path) == 3 or name == "model-chain"
    spies = counting(drafter)
    drafter.commit(handle, path, [tree.tokens[node] for node in path] + [0])
    assert spies["forward"].call_count == 0 and spies["truncate"].call_count == 0
    # every accepted node but the deepest level went through the last forward
    assert drafter.cached_length(handle) == len(PROMPT) + len(path) - 1
    fresh = fresh_proposal(make(name), drafter.text(handle), SAMPLED, 5, 8)
    generator.manual_seed(5)
    assert_same_proposal(drafter.propose([handle], [8])[0], fresh)


def test_the_assumed_path_of_a_tree_is_its_most_probable_leaf(make) -> None:
    drafter = make("model-tree")
    handle = drafter.open(PROMPT, SAMPLED, torch.Generator().manual_seed(1))
    [proposal] = drafter.propose([handle], [8])
    tree = proposal.tree
    assert not tree.is_chain
    drafter.assume_accepted(handle)
    path = match_path(tree, drafter.text(handle)[len(PROMPT) :])

    def path_prob(node: int) -> float:  # draft path probability: product of q along the path
        return float(torch.prod(torch.stack([proposal.draft_probs[n, tree.tokens[n]] for n in tree.path_to(node)])))

    leaves = [node for node in range(len(tree)) if not tree.children(node)]
    assert path[-1] == max(leaves, key=path_prob)


# --- pure helpers -----------------------------------------------------------------------------------------------

EXAMPLE = TokenTree((5, 6, 7, 8), (-1, -1, 0, 2))


def test_match_path_worked_examples() -> None:
    assert match_path(EXAMPLE, [5, 7, 1]) == [0, 2]
    assert match_path(EXAMPLE, [5, 7, 8, 9]) == [0, 2, 3]
    assert match_path(EXAMPLE, [6, 9]) == [1]
    assert match_path(EXAMPLE, [9]) == [] and match_path(EXAMPLE, []) == []
    duplicates = TokenTree((5, 5, 7), (-1, -1, 1))  # i.i.d. siblings may repeat a token: the longest match wins
    assert match_path(duplicates, [5, 7]) == [1, 2]


def test_most_probable_leaf_path_worked_examples() -> None:
    assert most_probable_leaf_path(EXAMPLE, [0.6, 0.4, 0.3, 0.1]) == [1]
    assert most_probable_leaf_path(EXAMPLE, [0.6, 0.1, 0.3, 0.2]) == [0, 2, 3]
    assert most_probable_leaf_path(TokenTree.chain([4, 4, 4]), [0.5, 0.2, 0.1]) == [0, 1, 2]
    assert most_probable_leaf_path(TokenTree.empty(), []) == []


# --- batching and per-sequence shapes -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_batch_proposes_what_each_sequence_proposes_alone(name: str, make) -> None:
    prompts = [PROMPT, [3], [7, 7, 7, 7, 7], [9, 8, 1, 9, 8, 2, 9]]
    budgets = [8, 2, 0, 5]
    drafter, alone = make(name), make(name)
    handles = [drafter.open(prompt, GREEDY, torch.Generator()) for prompt in prompts]
    batched = drafter.propose(handles, budgets)
    for prompt, budget, got in zip(prompts, budgets, batched, strict=True):
        assert_same_proposal(got, fresh_proposal(alone, prompt, GREEDY, 0, budget))
        assert len(got.tree) <= budget
    for handle in handles:
        drafter.close(handle)
    assert drafter.num_open == drafter.runner_sequences == 0


@pytest.mark.parametrize("kind", ["ngram", "model", "early-exit"])
def test_each_sequence_keeps_its_own_shape_in_one_batch(kind: str, target, draft) -> None:
    def build(config: DraftConfig):
        return build_drafter(kind, target, config, draft_model=draft, early_exit_layers=1)

    shared = build(CHAIN)
    shapes = [CHAIN, TREE, DraftConfig(num_draft_tokens=2, draft_top_k=3)]
    handles = [shared.open(PROMPT, SAMPLED, torch.Generator().manual_seed(7), shape) for shape in shapes]
    for shape, got in zip(shapes, shared.propose(handles, [8] * len(shapes)), strict=True):
        assert_same_proposal(got, fresh_proposal(build(shape), PROMPT, SAMPLED, 7, 8))


def test_drafting_stops_at_the_draft_models_context(target) -> None:
    drafter = ModelDrafter(KVRunner(target.model, num_layers=1, max_seq_len=12), CHAIN)
    handle = drafter.open(PROMPT, GREEDY, torch.Generator())  # 10 tokens: room for 3 levels, not 4
    [proposal] = drafter.propose([handle], [8])
    assert len(proposal.tree) == 3
    drafter.sync(handle, len(PROMPT), [1, 2, 3, 4])  # 14 tokens: past the context, nothing to propose, no error
    assert drafter.propose([handle], [8])[0].tree == TokenTree.empty()
    drafter.sync(handle, 5, [1])
    assert len(drafter.propose([handle], [8])[0].tree) == 4
    with pytest.raises(InvalidArgumentError, match="prompt"):
        drafter.open(list(range(13)), GREEDY, torch.Generator())
    drafter.close(handle)
    assert drafter.runner_sequences == 0


# --- bad calls name the field; nothing leaks --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ngram", "model-chain", "early-exit-tree"])
def test_bad_calls_name_the_field_and_change_nothing(name: str, make) -> None:
    drafter = make(name)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        drafter.open([], GREEDY, torch.Generator())
    with pytest.raises(InvalidArgumentError, match="prompt"):
        drafter.open([1, VOCAB], GREEDY, torch.Generator())
    assert drafter.num_open == drafter.runner_sequences == 0
    handle = drafter.open(PROMPT, GREEDY, torch.Generator())
    with pytest.raises(InvalidArgumentError, match="assume_previous_accepted"):
        drafter.assume_accepted(handle)  # nothing proposed yet
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        drafter.propose([handle], [-1])
    with pytest.raises(InvalidArgumentError, match="handles"):
        drafter.propose([handle, handle], [1, 1])
    with pytest.raises(KeyError):
        drafter.propose([handle + 1], [1])
    [proposal] = drafter.propose([handle], [8])
    bad_syncs = {
        "base_length": (len(PROMPT) + 1, [1]),
        "emitted": (len(PROMPT), [VOCAB]),
    }
    for field, (base, emitted) in bad_syncs.items():
        with pytest.raises(InvalidArgumentError, match=field):
            drafter.sync(handle, base, emitted)
    with pytest.raises(InvalidArgumentError, match="base_length"):
        drafter.sync(handle, -1, [1])
    with pytest.raises(InvalidArgumentError, match="emitted"):
        drafter.sync(handle, 0, [])
    if len(proposal.tree):
        first = proposal.tree.tokens[0]
        with pytest.raises(InvalidArgumentError, match="accepted_path"):
            drafter.commit(handle, [len(proposal.tree)], [first])
        with pytest.raises(InvalidArgumentError, match="emitted"):
            drafter.commit(handle, [0], [(first + 1) % VOCAB])
    assert drafter.text(handle) == PROMPT
    drafter.assume_accepted(handle)  # the proposal is still outstanding after the refused calls
    path = match_path(proposal.tree, drafter.text(handle)[len(PROMPT) :])
    assert len(path) == len(drafter.text(handle)) - len(PROMPT) > 0 and not proposal.tree.children(path[-1])
    drafter.close(handle)
    drafter.close(handle)  # closing twice is harmless
    with pytest.raises(KeyError):
        drafter.sync(handle, 1, [])
    assert drafter.num_open == drafter.runner_sequences == 0


@pytest.mark.parametrize("name", MODEL_DRAFTERS)
def test_a_failed_prefill_leaks_no_runner_sequence(name: str, make) -> None:
    drafter = make(name)
    with (
        mock.patch.object(drafter.runner, "forward", side_effect=RuntimeError("device lost")),
        pytest.raises(RuntimeError, match="device lost"),
    ):
        drafter.open(PROMPT, GREEDY, torch.Generator())
    assert drafter.num_open == drafter.runner_sequences == 0


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_many_sequences_leave_nothing_open(name: str, make) -> None:
    rng = random.Random(name)
    drafter = make(name)
    open_texts: dict[int, tuple[list[int], TokenTree | None]] = {}
    for step in range(200):
        if len(open_texts) < 6 and rng.random() < 0.3:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
            open_texts[drafter.open(prompt, SAMPLED, torch.Generator().manual_seed(step))] = (prompt, None)
        elif open_texts and rng.random() < 0.15:
            victim = rng.choice(list(open_texts))
            drafter.close(victim)  # mid-flight: a proposal may be outstanding
            del open_texts[victim]
        elif open_texts:
            handles = rng.sample(list(open_texts), rng.randint(1, len(open_texts)))
            proposals = drafter.propose(handles, [rng.randint(0, 8) for _ in handles])
            for handle, proposal in zip(handles, proposals, strict=True):
                text, _ = open_texts[handle]
                open_texts[handle] = random_move(rng, drafter, handle, text, proposal.tree)
        assert drafter.num_open == len(open_texts)
        assert drafter.runner_sequences == (len(open_texts) if isinstance(drafter, ModelDrafter) else 0)
    for handle in open_texts:
        drafter.close(handle)
    assert drafter.num_open == drafter.runner_sequences == 0


def test_ngram_drafter_is_a_sequence_drafter() -> None:
    drafter = NgramDrafter(DraftConfig(num_draft_tokens=2), vocab_size=VOCAB)
    handle = drafter.open([1, 2, 3, 1], GREEDY, torch.Generator())
    assert drafter.propose([handle], [5])[0].tree.tokens == (2, 3)
    drafter.assume_accepted(handle)
    assert drafter.text(handle) == [1, 2, 3, 1, 2, 3]
    assert drafter.propose([handle], [5])[0].tree.tokens == (1, 2)
    drafter.sync(handle, 4, [2, 9])  # 3 rejected, correction 9
    assert drafter.text(handle) == [1, 2, 3, 1, 2, 9]
    assert drafter.propose([handle], [5])[0].tree.tokens == ()
    drafter.close(handle)
