"""Which rounds a trained head should leave to prompt lookup, measured on held-out rows when ``specdec distill`` ends.

An eagle drafter drafts a round by prompt lookup (:mod:`specdec.lookup`) when the text's tail, at least
``lookup_min_match`` tokens of it, occurred earlier. Where that pays depends on the head: a strong head out-drafts a
chance match of three or four tokens, while a weak one (the few minutes' head ``make demo`` trains) loses to a match of
two (``bench/results/eagle-lookup-demo-head.md``). So distill measures, at every held-out response row, the greedy
chain each would have had accepted, and keeps the tail length the rows say commits most.

At a row the text runs up to some token; the target's greedy continuation is known where the text goes on with the
target's argmax (every row of a greedy response). A chain's **accepted length** there counts its leading tokens that
equal the text's next tokens while the text is the target's argmax: exactly what greedy verification accepts. The
head's chain at depth ``k`` is the head's argmax at unroll step ``k`` of the row ``k`` later (unroll step ``k``
drafts from the head's own rows of the ``k`` positions before, as serving does:
:func:`specdec.distill.train.unrolled_forward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.distill.train import Batch, unrolled_forward
from specdec.drafters.eagle_head import EagleHead
from specdec.lookup import LOOKUP_MAX_MATCH, LookupIndex
from specdec.sampling import argmax

CHAIN_DEPTH = 4  # the served default's chain (num_draft_tokens)
TOLERANCE = 0.01  # a candidate this close to the best (relative) is as good: the rows cannot tell them apart


@dataclass(frozen=True)
class RowChains:
    """Per held-out response row: the head's accepted length, prompt lookup's, and the tail that lookup matched
    (0: none)."""

    head: torch.Tensor
    lookup: torch.Tensor
    match: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[RowChains]) -> RowChains:
        return RowChains(*(torch.cat([getattr(part, name) for part in parts]) for name in ("head", "lookup", "match")))


@dataclass(frozen=True)
class LookupChoice:
    """The chosen ``min_match`` (0: never look up) and, per candidate, the mean accepted length it gives a row."""

    min_match: int
    accepted: dict[int, float]


def row_chains(head: EagleHead, batch: Batch, depth: int = CHAIN_DEPTH) -> RowChains:
    """Accepted lengths of ``batch``'s response rows (held-out batches, marked with the target's argmax by
    :func:`~specdec.distill.train.with_target_argmax`), in the order of its loss rows."""
    if batch.target_top is None or batch.target_token is None:
        raise ValueError("row_chains needs held-out batches with the target's argmax (with_target_argmax)")
    mask, tokens = batch.loss_mask, batch.tokens
    count, length = tokens.shape
    target_token = torch.full((count, length), -1, dtype=torch.long)
    target_token[mask] = batch.target_token
    # the text goes on with the target's argmax after row j (the last row's next token is not in the batch)
    greedy = torch.zeros(count, length, dtype=torch.bool)
    greedy[:, :-1] = mask[:, :-1] & mask[:, 1:] & (target_token[:, :-1] == tokens[:, 1:])
    head_ok = torch.zeros(depth, count, length, dtype=torch.bool)
    with torch.no_grad():
        states, rows = unrolled_forward(head, batch, depth)
        for step, state in enumerate(states):
            drafted = argmax(head.lm_head(head.output(state[rows].float())))
            head_ok[step][mask] = drafted == batch.target_top
    parts = []
    for row in range(count):
        positions = torch.nonzero(mask[row]).flatten().tolist()
        text = tokens[row].tolist()
        ok = greedy[row].tolist()
        agrees = head_ok[:, row].tolist()
        index = LookupIndex(text[: positions[0]] if positions else ())
        head_lengths, lookup_lengths, matches = [], [], []
        for position in positions:
            index.extend(text[len(index) : position + 1])
            within = range(min(depth, length - position))
            head_lengths.append(_leading([agrees[k][position + k] for k in within], ok, position))
            match, chain = _longest_match(index, depth)
            copied = range(min(len(chain), length - 1 - position))
            lookup_lengths.append(_leading([chain[k] == text[position + 1 + k] for k in copied], ok, position))
            matches.append(match)
        parts.append(RowChains(*(torch.tensor(v, dtype=torch.long) for v in (head_lengths, lookup_lengths, matches))))
    return RowChains.cat(parts) if parts else RowChains(*(torch.zeros(0, dtype=torch.long) for _ in range(3)))


def _leading(agrees: list[bool], greedy: list[bool], position: int) -> int:
    """How many of a chain's tokens from ``position`` are accepted (``agrees[k]``: its token ``k`` is the text's):
    each must agree while the text is the target's argmax."""
    accepted = 0
    while accepted < len(agrees) and agrees[accepted] and greedy[position + accepted]:
        accepted += 1
    return accepted


def _longest_match(index: LookupIndex, depth: int) -> tuple[int, list[int]]:
    """The longest tail (up to :data:`LOOKUP_MAX_MATCH`) that occurred before, and the chain it looks up. The
    chain is the same for every ``min_match`` up to that tail (the longest match is the one followed)."""
    match, chain = 0, []
    for size in range(1, LOOKUP_MAX_MATCH + 1):
        found = index.prompt_lookup(size, depth)
        if not found:
            break
        match, chain = size, found
    return match, chain


def choose_min_match(chains: RowChains) -> LookupChoice:
    """The ``min_match`` whose rows commit most: a row with a tail match at least that long takes lookup's chain,
    every other row the head's. Of the candidates within :data:`TOLERANCE` of the best, the largest (0, never,
    first): fewer rounds change hands on a difference the rows cannot show, and shorter tails, measured here on
    greedy rows alone, lost more at temperature 0.7 (``bench/results/eagle-lookup-demo-head.md``: a tail of 1 was
    level with 2 greedy, 0.10x of target-only behind it sampled)."""
    accepted = {0: float(chains.head.float().mean()) if len(chains.head) else 0.0}
    for size in range(LOOKUP_MAX_MATCH, 0, -1):
        taken = torch.where(chains.match >= size, chains.lookup, chains.head)
        accepted[size] = float(taken.float().mean()) if len(taken) else 0.0
    enough = max(accepted.values()) * (1 - TOLERANCE)
    return LookupChoice(next(size for size, value in accepted.items() if value >= enough), accepted)


def calibrate_lookup(head: EagleHead, batches: Sequence[Batch], depth: int = CHAIN_DEPTH) -> LookupChoice:
    """:func:`choose_min_match` over the response rows of the held-out ``batches``."""
    was_training = head.training
    head.eval()
    try:
        chains = RowChains.cat([row_chains(head, batch, depth) for batch in batches])
    finally:
        head.train(was_training)
    return choose_min_match(chains)
