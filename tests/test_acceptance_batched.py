"""``verify_batched`` is bit-identical to ``verify_reference`` under the same random numbers.

Random batches (explicit seeds): ragged draft sizes including empty drafts, chains (the vectorised path)
and trees of random shapes (the per-level path), drafts from a model (siblings share their parent's
``q`` row), ``q == p``, one-hot ``q`` (``None``), greedy targets and drafts, top-k/top-p truncation, both
sibling schemes, EOS and budget truncation, float32 and float64 uniforms, uniforms set exactly on the
acceptance threshold. Padding is NaN, so anything read past a sequence's own size would show.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specdec.acceptance import sample_with_uniforms, verify_batched, verify_reference
from specdec.sampling import SamplingParams, logits_to_probs, sample_with_uniform
from specdec.tree import TokenTree

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.5, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8),
]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Many small tensor ops: intra-op threads only add overhead (and dominate on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Case:
    tree: TokenTree
    target_probs: torch.Tensor  # [N + 1, V]
    draft_probs: torch.Tensor | None  # [N, V]
    accept_uniforms: torch.Tensor  # [N]
    draw_uniform: torch.Tensor  # []
    max_new_tokens: int
    eos: frozenset[int]


def _pick(generator: torch.Generator, options: list):
    return options[int(torch.randint(len(options), (), generator=generator))]


def _random_case(
    generator: torch.Generator, vocab: int, draft: str, scheme: str, chain: bool, dtype: torch.dtype
) -> Case:
    """``draft``: "model" (a row per parent), "equal" (q = p of the parent) or "none" (one-hot q)."""
    wanted = int(torch.randint(0, 9, (), generator=generator))
    logits = 2 * torch.randn(wanted + 1, vocab, generator=generator)
    target = logits_to_probs(logits, _pick(generator, PARAMS))
    if draft == "equal":
        slots = target
    else:  # a related draft: the target's logits plus noise of a random scale
        noise = _pick(generator, [0.3, 1.0, 3.0]) * torch.randn(wanted + 1, vocab, generator=generator)
        slots = logits_to_probs(logits + noise, _pick(generator, PARAMS))
    tokens: list[int] = []
    parents: list[int] = []
    for node in range(wanted):
        parent = node - 1 if chain else int(torch.randint(-1, node, (), generator=generator))
        row = slots[parent + 1].clone() if draft != "none" else torch.ones(vocab)
        if scheme == "without_replacement" or draft == "none":
            siblings = [token for token, p in zip(tokens, parents, strict=True) if p == parent]
            if scheme == "without_replacement":
                row[siblings] = 0.0
        if not row.gt(0).any():
            break
        tokens.append(int(torch.multinomial(row, 1, generator=generator)))
        parents.append(parent)
    size = len(tokens)
    target = target[: size + 1]
    draft_probs = None if draft == "none" else slots[torch.tensor(parents, dtype=torch.long) + 1]
    uniforms = torch.rand(size, generator=generator, dtype=dtype)
    if size and draft != "none" and bool(torch.rand((), generator=generator) < 0.3):
        node = int(torch.randint(size, (), generator=generator))  # on its threshold if tried first
        ratio = target.double()[parents[node] + 1, tokens[node]] / draft_probs.double()[node, tokens[node]]
        uniforms[node] = min(float(ratio), 0.5)
    eos = frozenset(
        torch.randint(vocab, (int(torch.randint(0, 3, (), generator=generator)),), generator=generator).tolist()
    )
    return Case(
        tree=TokenTree(tuple(tokens), tuple(parents)),
        target_probs=target,
        draft_probs=draft_probs,
        accept_uniforms=uniforms,
        draw_uniform=torch.rand((), generator=generator, dtype=dtype),
        max_new_tokens=int(torch.randint(1, size + 3, (), generator=generator)),
        eos=eos,
    )


def _padded(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.full((len(tensors), length, *tensors[0].shape[1:]), float("nan"), dtype=tensors[0].dtype)
    for index, tensor in enumerate(tensors):
        out[index, : len(tensor)] = tensor
    return out


def _assert_batched_matches_reference(cases: list[Case], scheme: str) -> None:
    width = max(len(case.tree) for case in cases)
    none = cases[0].draft_probs is None
    batched = verify_batched(
        [case.tree for case in cases],
        _padded([case.target_probs for case in cases], width + 1),
        None if none else _padded([case.draft_probs for case in cases], width),
        _padded([case.accept_uniforms for case in cases], width),
        torch.stack([case.draw_uniform for case in cases]),
        scheme=scheme,
        max_new_tokens=[case.max_new_tokens for case in cases],
        eos_token_ids=[case.eos for case in cases],
    )
    for case, verdict in zip(cases, batched, strict=True):
        reference = verify_reference(
            case.tree,
            case.target_probs,
            case.draft_probs,
            case.accept_uniforms,
            float(case.draw_uniform),
            scheme=scheme,
            max_new_tokens=case.max_new_tokens,
            eos_token_ids=case.eos,
        )
        assert verdict == reference, case


@pytest.mark.parametrize("chain", [True, False], ids=["chains", "trees"])
@pytest.mark.parametrize("draft", ["model", "equal", "none"])
@pytest.mark.parametrize("scheme", ["iid", "without_replacement"])
def test_batched_is_bit_identical_to_reference(chain: bool, draft: str, scheme: str) -> None:
    generator = torch.Generator().manual_seed(
        ["model", "equal", "none"].index(draft) * 4 + 2 * chain + (scheme == "iid")
    )
    for _ in range(25):
        vocab = int(torch.randint(2, 14, (), generator=generator))
        dtype = _pick(generator, [torch.float32, torch.float64])
        cases = [_random_case(generator, vocab, draft, scheme, chain, dtype) for _ in range(16)]
        _assert_batched_matches_reference(cases, scheme)


def test_equal_distributions_accept_the_first_child_at_every_level() -> None:
    generator = torch.Generator().manual_seed(1)
    cases = [_random_case(generator, 9, "equal", "iid", False, torch.float64) for _ in range(64)]
    verdicts = verify_batched(
        [case.tree for case in cases],
        _padded([case.target_probs for case in cases], 9),
        _padded([case.draft_probs for case in cases], 8),
        _padded([case.accept_uniforms for case in cases], 8),
        torch.stack([case.draw_uniform for case in cases]),
        max_new_tokens=[99] * len(cases),
        eos_token_ids=[()] * len(cases),
    )
    for case, verdict in zip(cases, verdicts, strict=True):
        node, path = -1, []
        while case.tree.children(node):
            node = case.tree.children(node)[0]
            path.append(node)
        assert verdict.accepted_path == path and verdict.final_token_kind == "bonus"


def test_empty_drafts_draw_the_bonus_from_row_zero() -> None:
    generator = torch.Generator().manual_seed(2)
    probs = torch.softmax(torch.randn(32, 1, 7, generator=generator), dim=-1)
    draws = torch.rand(32, generator=generator, dtype=torch.float64)
    verdicts = verify_batched(
        [TokenTree.empty()] * 32,
        probs,
        None,
        torch.empty(32, 0),
        draws,
        max_new_tokens=[5] * 32,
        eos_token_ids=[()] * 32,
    )
    for row, draw, verdict in zip(probs, draws.tolist(), verdicts, strict=True):
        assert verdict.emitted == [sample_with_uniform(row[0], draw)]
        assert (verdict.accepted_path, verdict.final_token_kind, verdict.final_row) == ([], "bonus", 0)
    assert verify_batched([], probs, None, torch.empty(0, 0), draws, max_new_tokens=[], eos_token_ids=[]) == []


def test_sample_with_uniforms_matches_the_single_row_draw() -> None:
    generator = torch.Generator().manual_seed(3)
    probs = torch.softmax(3 * torch.randn(400, 11, generator=generator), dim=-1)
    probs[probs < 0.05] = 0.0
    probs[::7, -3:] = 0.0  # zero tail: the top end of the cdf must not land there
    probs[::7, 4] = 0.5
    uniforms = torch.rand(400, generator=generator, dtype=torch.float64)
    uniforms[:50] = torch.tensor([0.0, 1.0 - 2.0**-53]).repeat(25)
    expected = [sample_with_uniform(row, u) for row, u in zip(probs, uniforms.tolist(), strict=True)]
    assert sample_with_uniforms(probs, uniforms).tolist() == expected
