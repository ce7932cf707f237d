"""The acceptance rule: which drafted tokens the target commits, and the one token it adds.

Speculative sampling of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192, §2.3 and appendix A.1), extended to token trees by the multi-round
speculative sampling of SpecInfer (Miao et al. 2023, arXiv 2305.09781, §4.2). Starting at the root, the
children of the current node are tried in proposal order against ``p'`` (first the target's ``p`` there):

* child ``c`` with token ``x`` is **accepted** iff ``u_c < p'(x) / q_c(x)`` (probability ``min(1, p'/q)``),
  and the walk moves down to ``c``;
* after each rejection ``p' <- norm(max(0, p' - q_c))``; when every child was rejected one **recovered**
  token (vLLM's name; DESIGN §3 calls it the correction) is drawn from that ``p'``;
* when the node reached has no children (e.g. a chain fully accepted) one **bonus** token is drawn from ``p``.

A chain is a tree with one child per node, so this is also the chain rule of DESIGN §3. Greedy is the
one-hot limit: with one-hot ``p`` the child equal to ``argmax p`` is accepted and every other is rejected.

Shapes: ``N`` draft nodes, ``V`` vocabulary, ``B`` sequences. Row 0 of ``target_probs`` is ``p(.|h)`` and row
``i + 1`` is ``p(.|h, path to node i)``: the logits at node ``i``'s position verify node ``i``'s children
(the off-by-one of DESIGN §3). Row ``i`` of ``draft_probs`` is the ``q`` node ``i`` was sampled from;
``None`` (n-gram drafts) means a one-hot ``q`` at each node's own token.

Schemes, i.e. how the siblings of one node were drawn:

* ``"iid"``: independently, each from its own row (i.i.d. when the rows are equal);
* ``"without_replacement"``: one after another without replacement. The ``q`` of a sibling is its row with
  the tokens of the earlier (already rejected) siblings removed and renormalised, so the drafter may send
  either the base row or the reduced one; ``p'`` is updated with that reduced ``q``.

Both coincide for one-hot ``q``. Randomness is explicit: ``accept_uniforms[i]`` decides node ``i`` (unused
when node ``i`` is never tried) and one draw uniform picks the final token by inverse CDF
(:func:`specdec.sampling.sample_with_uniform`). Everything is computed in float64; row sums are taken with
a sequential ``cumsum`` so that :func:`verify_batched` is bit-identical to :func:`verify_reference` on CPU.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from specdec.sampling import argmax, sample_with_uniform
from specdec.tree import ROOT, TokenTree

Scheme = Literal["iid", "without_replacement"]
FinalKind = Literal["recovered", "bonus"]
SCHEMES = ("iid", "without_replacement")


@dataclass(frozen=True)
class Verdict:
    """What one verification round commits, after the stop rules.

    ``accepted_path`` lists the accepted nodes root to leaf, ``emitted`` their tokens followed by the
    recovered or bonus token. ``final_token_kind`` and ``final_row`` (the ``target_probs`` row the final
    token was drawn from) are None when EOS or the budget cut the round before its final token.
    ``finished`` is True when an EOS was emitted or ``max_new_tokens`` tokens were.
    """

    accepted_path: list[int]
    emitted: list[int]
    num_accepted: int
    final_token_kind: FinalKind | None
    final_row: int | None
    finished: bool


def recovered_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` row by row; ``p`` where that residual is all zeros.

    Args:
        target_probs: float64 [..., V], the current ``p'``.
        draft_probs: float64 [..., V], the ``q`` of the rejected token.

    A rejection of ``x`` means ``p'(x) < q(x)``; both sum to one, so ``sum max(0, p' - q) = sum max(0, q - p')
    >= q(x) - p'(x) > 0``: in exact arithmetic the 0/0 residual (``p' = q``) is never formed. In floats a
    residual of rounding noise can underflow to zeros (``p'`` and ``q`` equal up to rounding); ``p'`` itself is
    then the distribution the residual approximates.
    """
    residual = _normalise(torch.clamp(target_probs - draft_probs, min=0.0))
    return torch.where(residual.gt(0).any(dim=-1, keepdim=True), residual, target_probs)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row-wise :func:`specdec.sampling.sample_with_uniform`, the same ids bit for bit.

    Args:
        probs: float [B, V], rows need not be normalised.
        uniforms: float [B] in [0, 1).

    Returns: long [B].
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    scaled = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, scaled, right=True).clamp(max=probs.shape[-1] - 1)
    positions = torch.arange(probs.shape[-1]).expand_as(probs)
    last_positive = torch.where(probs > 0, positions, -1).cummax(dim=-1).values
    return last_positive.gather(-1, index).squeeze(-1)


def verify_reference(
    tree: TokenTree,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    draw_uniform: float,
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int] = frozenset(),
    scheme: Scheme = "iid",
) -> Verdict:
    """The rule for one sequence, written plainly (see the module docstring).

    Args:
        tree: the N draft nodes.
        target_probs: float [N + 1, V], row ``i + 1`` verifies the children of node ``i``.
        draft_probs: float [N, V], or None for a one-hot ``q`` at each node's token.
        accept_uniforms: float [N] in [0, 1).
        draw_uniform: in [0, 1), for the recovered or bonus token.
        max_new_tokens: remaining budget (>= 1); eos_token_ids: tokens that end the sequence.
    """
    _check_scheme(scheme)
    _check_shapes(len(tree), target_probs, draft_probs, accept_uniforms)
    p = target_probs.double()
    vocab = p.shape[-1]
    q = _one_hot(torch.tensor(tree.tokens, dtype=torch.long), vocab) if draft_probs is None else draft_probs.double()
    node, path = ROOT, []
    while True:
        residual = p[node + 1]
        children = tree.children(node)
        rejected_tokens: list[int] = []
        accepted = ROOT
        for child in children:
            token, draft = tree.tokens[child], q[child]
            if scheme == "without_replacement" and rejected_tokens:
                draft = _normalise(draft.index_fill(0, torch.tensor(rejected_tokens), 0.0))
            _check_proposed(draft[token] > 0)
            if float(accept_uniforms[child]) < float(residual[token] / draft[token]):
                accepted = child
                break
            residual = recovered_probs(residual, draft)
            rejected_tokens.append(token)
        if accepted == ROOT:
            break
        node = accepted
        path.append(node)
    final = sample_with_uniform(residual, float(draw_uniform))
    return _verdict(tree, path, final, "recovered" if children else "bonus", max_new_tokens, eos_token_ids)


def verify_greedy(
    tree: TokenTree,
    target_probs: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: Collection[int] = frozenset(),
) -> Verdict:
    """Temperature 0: follow the child equal to ``argmax p`` (lowest id on ties), then emit ``argmax p``.

    Args:
        target_probs: float [N + 1, V] (probabilities or logits: only the argmax is used).
    """
    _check_shapes(len(tree), target_probs, None, None)
    best = argmax(target_probs).tolist()
    node, path = ROOT, []
    while True:
        children = tree.children(node)
        match = next((child for child in children if tree.tokens[child] == best[node + 1]), ROOT)
        if match == ROOT:
            break
        node = match
        path.append(node)
    return _verdict(tree, path, best[node + 1], "recovered" if children else "bonus", max_new_tokens, eos_token_ids)


class SampledRule(Protocol):
    """The signature of :func:`verify_batched`: what a :class:`~specdec.verification.BatchVerifier` applies to its
    sampled (temperature > 0) rounds. The verifier takes one as a parameter so that a test can build a verifier
    with a deliberately wrong rule (``specdec check`` must catch it); production always uses :func:`verify_batched`."""

    def __call__(
        self,
        trees: Sequence[TokenTree],
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor | None,
        accept_uniforms: torch.Tensor,
        draw_uniforms: torch.Tensor,
        *,
        max_new_tokens: Sequence[int],
        eos_token_ids: Sequence[Collection[int]],
        scheme: Scheme = "iid",
    ) -> list[Verdict]: ...


def verify_batched(
    trees: Sequence[TokenTree],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    draw_uniforms: torch.Tensor,
    *,
    max_new_tokens: Sequence[int],
    eos_token_ids: Sequence[Collection[int]],
    scheme: Scheme = "iid",
) -> list[Verdict]:
    """:func:`verify_reference` for B sequences at once, bit for bit (CPU); ragged drafts are padded.

    Chains are vectorised over batch and depth, trees over the batch (looping over depth and sibling rank).

    Args:
        trees: B trees, ``n_b = len(trees[b]) <= N``.
        target_probs: float [B, N + 1, V], rows past ``n_b + 1`` are ignored.
        draft_probs: float [B, N, V] or None (one-hot ``q`` for every sequence); rows past ``n_b`` ignored.
        accept_uniforms: float [B, N]; draw_uniforms: float [B].
        max_new_tokens, eos_token_ids: one entry per sequence.
    """
    if not trees:
        return []
    _check_scheme(scheme)
    width = max(len(tree) for tree in trees)
    for batched in (target_probs, draft_probs, accept_uniforms, draw_uniforms):
        if batched is not None and batched.shape[0] != len(trees):
            raise ValueError(f"expected {len(trees)} sequences, got a tensor of shape {tuple(batched.shape)}")
    _check_shapes(width, target_probs[0], None if draft_probs is None else draft_probs[0], accept_uniforms[0])
    p = target_probs[:, : width + 1]
    q = None if draft_probs is None else draft_probs[:, :width]
    tokens = torch.tensor([list(tree.tokens) + [0] * (width - len(tree)) for tree in trees], dtype=torch.long)
    uniforms = accept_uniforms[:, :width].double()
    if width and all(tree.is_chain for tree in trees):
        lengths = torch.tensor([len(tree) for tree in trees])
        paths, dist, recovered = _verify_chains(lengths, p, q, tokens, uniforms)
    else:
        paths, dist, recovered = _verify_trees(trees, p, q, tokens, uniforms, scheme)
    finals = sample_with_uniforms(dist, draw_uniforms).tolist()
    return [
        _verdict(tree, path, final, "recovered" if rec else "bonus", limit, eos)
        for tree, path, final, rec, limit, eos in zip(
            trees, paths, finals, recovered.tolist(), max_new_tokens, eos_token_ids, strict=True
        )
    ]


def _verify_chains(
    lengths: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, uniforms: torch.Tensor
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Chains: lengths [B], p [B, N+1, V], q [B, N, V] or None, tokens [B, N], uniforms float64 [B, N]; N >= 1.

    Only the rows and entries used are converted to float64 (a [B, N+1, V] copy is large for big vocabularies).
    """
    width = tokens.shape[1]
    valid = torch.arange(width) < lengths[:, None]
    p_token = p[:, :width].gather(2, tokens[..., None]).squeeze(2).double()
    q_token = torch.ones_like(p_token) if q is None else q.gather(2, tokens[..., None]).squeeze(2).double()
    accepted = valid & (uniforms < p_token / q_token)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    _check_proposed(q_token[valid & (torch.arange(width) <= num_accepted[:, None])] > 0)  # the nodes tried
    recovered = num_accepted < lengths
    at = num_accepted.clamp(max=width - 1)
    target_row = _take(p, num_accepted).double()
    draft_row = _draft_rows(q, _take(tokens, at), at, target_row.shape[-1])
    dist = torch.where(recovered[:, None], recovered_probs(target_row, draft_row), target_row)
    return [list(range(count)) for count in num_accepted.tolist()], dist, recovered


def _verify_trees(
    trees: Sequence[TokenTree],
    p: torch.Tensor,
    q: torch.Tensor | None,
    tokens: torch.Tensor,
    uniforms: torch.Tensor,
    scheme: Scheme,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Trees: p [B, N+1, V], q [B, N, V] or None, tokens [B, N], uniforms [B, N]; one level per iteration."""
    batch, vocab = p.shape[0], p.shape[-1]
    table = _children_table(trees, tokens.shape[1])
    node = torch.full((batch,), ROOT)
    active = torch.ones(batch, dtype=torch.bool)
    dist = torch.zeros(batch, vocab, dtype=torch.float64)
    recovered = torch.zeros(batch, dtype=torch.bool)
    steps = []
    while active.any():
        residual, children = _take(p, node + 1).double(), _take(table, node + 1)
        chosen = torch.full((batch,), ROOT)
        removed = torch.zeros(batch, vocab, dtype=torch.bool)
        for rank in range(children.shape[1]):
            child = children[:, rank]
            trying = active & (chosen == ROOT) & (child != ROOT)
            if not trying.any():
                break
            index = child.clamp(min=0)
            token = _take(tokens, index)
            draft = _draft_rows(q, token, index, vocab)
            if scheme == "without_replacement" and rank > 0:
                draft = _normalise(draft.masked_fill(removed, 0.0))
            q_token = _take(draft, token)
            _check_proposed(q_token[trying] > 0)
            accept = trying & (_take(uniforms, index) < _take(residual, token) / q_token)
            rejected = trying & ~accept
            chosen = torch.where(accept, child, chosen)
            residual = torch.where(rejected[:, None], recovered_probs(residual, draft), residual)
            if scheme == "without_replacement":
                removed |= rejected[:, None] & (torch.arange(vocab) == token[:, None])
        stop = active & (chosen == ROOT)
        dist = torch.where(stop[:, None], residual, dist)
        recovered |= stop & (children[:, 0] != ROOT)
        active &= ~stop
        node = torch.where(active, chosen, node)
        steps.append(torch.where(active, chosen, ROOT))
    return [[n for n in row if n != ROOT] for row in torch.stack(steps, dim=1).tolist()], dist, recovered


def _children_table(trees: Sequence[TokenTree], width: int) -> torch.Tensor:
    """long [B, N + 1, K]: entry ``[b, n + 1, k]`` is the k-th child of node n (ROOT-padded); K >= 1.

    Built once per distinct shape: a batch usually repeats a few tree shapes.
    """
    shapes: dict[tuple[int, ...], int] = {}
    shape_ids = torch.tensor([shapes.setdefault(tree.parents, len(shapes)) for tree in trees])
    children = [[[] for _ in range(width + 1)] for _ in shapes]
    for parents, shape_id in shapes.items():
        for node, parent in enumerate(parents):
            children[shape_id][parent + 1].append(node)
    fanout = max(len(kids) for table in children for kids in table)
    padded = [[kids + [ROOT] * (max(fanout, 1) - len(kids)) for kids in table] for table in children]
    return torch.tensor(padded, dtype=torch.long)[shape_ids]


def _draft_rows(q: torch.Tensor | None, token: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 [B, V]: ``q[b, index[b]]``, or the one-hot of ``token`` [B] when q is None."""
    return _one_hot(token, vocab) if q is None else _take(q, index).double()


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b]]`` for x [B, M, ...] and index long [B] (a gather: faster than advanced indexing)."""
    view = index.view(-1, *([1] * (x.dim() - 1))).expand(-1, 1, *x.shape[2:])
    return x.gather(1, view).squeeze(1)


def _one_hot(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(tokens, vocab).double()


def _normalise(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., V] over its row sums (sequential cumsum: same bits alone or batched); zero rows stay zero."""
    total = torch.cumsum(x, dim=-1)[..., -1:]
    return x / torch.where(total > 0, total, torch.ones_like(total))


def _check_proposed(positive: torch.Tensor) -> None:
    if not bool(positive.all()):
        raise ValueError("a proposed token has draft probability 0 (or repeats a sibling drawn without replacement)")


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")


def _check_shapes(
    size: int, target_probs: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None
) -> None:
    """Shapes of one sequence: target [>= size + 1, V], draft [>= size, V], uniforms [>= size]."""
    if target_probs.dim() != 2 or target_probs.shape[0] < size + 1:
        raise ValueError(f"target_probs needs {size + 1} rows, got shape {tuple(target_probs.shape)}")
    if draft_probs is not None and (draft_probs.shape[0] < size or draft_probs.shape[1:] != target_probs.shape[1:]):
        raise ValueError(f"draft_probs needs shape [{size}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
    if uniforms is not None and uniforms.shape[0] < size:
        raise ValueError(f"accept_uniforms needs {size} entries, got {uniforms.shape[0]}")


def _verdict(
    tree: TokenTree,
    path: list[int],
    final: int,
    kind: FinalKind,
    max_new_tokens: int,
    eos_token_ids: Collection[int],
) -> Verdict:
    """Apply the stop rules: keep everything up to the first EOS, at most ``max_new_tokens`` tokens."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    emitted = [tree.tokens[node] for node in path] + [final]
    stop = next((i + 1 for i, token in enumerate(emitted) if token in eos_token_ids), len(emitted))
    keep = min(stop, max_new_tokens)
    final_kept = keep > len(path)
    return Verdict(
        accepted_path=path[:keep],
        emitted=emitted[:keep],
        num_accepted=min(keep, len(path)),
        final_token_kind=kind if final_kept else None,
        final_row=(path[-1] + 1 if path else 0) if final_kept else None,
        finished=emitted[keep - 1] in eos_token_ids or keep == max_new_tokens,
    )
