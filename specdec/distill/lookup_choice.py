"""Which rounds a trained head should leave to prompt lookup, measured on held-out rows when ``specdec distill`` ends.

An eagle drafter drafts a round by prompt lookup (:mod:`specdec.lookup`) when the text's tail, at least
``lookup_min_match`` tokens of it, occurred earlier. Where that pays depends on the head: a strong head out-drafts a
chance match of three or four tokens, while a weak one (the few minutes' head ``make demo`` trains) loses to a match of
two (``bench/results/eagle-lookup-demo-head.md``). So distill measures, at every held-out response row, the greedy
chain each would have had accepted, walks each held-out text as greedy serving would (a round at a row commits its
accepted tokens and one more, and the next round starts after them) for every candidate tail, and keeps the tail
whose walk commits most tokens per round.

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
    """Per held-out response row, in the order of the texts' rows: the head's accepted length, prompt lookup's, the
    tail that lookup matched (0: none), and which text the row is in (rows of one text follow each other)."""

    head: torch.Tensor
    lookup: torch.Tensor
    match: torch.Tensor
    text: torch.Tensor

    @staticmethod
    def cat(parts: Sequence[RowChains]) -> RowChains:
        """The rows of ``parts``, each part's texts numbered after the previous part's."""
        if not parts:
            return RowChains(*(torch.zeros(0, dtype=torch.long) for _ in range(4)))
        texts, offset = [], 0
        for part in parts:
            texts.append(part.text + offset)
            offset += int(part.text.max()) + 1 if len(part.text) else 0
        columns = [torch.cat([getattr(part, name) for part in parts]) for name in ("head", "lookup", "match")]
        return RowChains(*columns, torch.cat(texts))


@dataclass(frozen=True)
class LookupChoice:
    """The chosen ``min_match`` (0: never look up) and, per candidate, the tokens a round commits walking the
    held-out texts with it."""

    min_match: int
    tokens_per_round: dict[int, float]


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
        before = batch.context[row].tolist() if batch.context else []  # the text before the window: serving reads it
        index = LookupIndex(before + text[: positions[0]] if positions else ())
        head_lengths, lookup_lengths, matches = [], [], []
        for position in positions:
            index.extend(text[len(index) - len(before) : position + 1])
            within = range(min(depth, length - position))
            head_lengths.append(_leading([agrees[k][position + k] for k in within], ok, position))
            match, chain = _longest_match(index, depth)
            copied = range(min(len(chain), length - 1 - position))
            lookup_lengths.append(_leading([chain[k] == text[position + 1 + k] for k in copied], ok, position))
            matches.append(match)
        columns = (head_lengths, lookup_lengths, matches, [0] * len(positions))  # one text
        parts.append(RowChains(*(torch.tensor(column, dtype=torch.long) for column in columns)))
    return RowChains.cat(parts)


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
    """The ``min_match`` whose walk of the texts commits most tokens per round: a round at a row with a tail match
    at least that long takes lookup's chain, every other round the head's. Of the candidates within
    :data:`TOLERANCE` of the best, the largest (0, never, first): fewer rounds change hands on a difference the rows
    cannot show, and shorter tails, measured here on greedy rows alone, lost more at temperature 0.7
    (``bench/results/eagle-lookup-demo-head.md``: a tail of 1 was level with 2 greedy, 0.10x of target-only behind
    it sampled)."""
    head, lookup, match = (column.tolist() for column in (chains.head, chains.lookup, chains.match))
    ends = _text_ends(chains.text.tolist())
    walked = {}
    for size in (0, *range(LOOKUP_MAX_MATCH, 0, -1)):
        tokens = rounds = row = 0
        while row < len(ends):
            accepted = lookup[row] if size and match[row] >= size else head[row]
            step = min(accepted + 1, ends[row] - row)  # a round commits its accepted tokens and one more
            tokens, rounds, row = tokens + step, rounds + 1, row + step
        walked[size] = tokens / rounds if rounds else 1.0
    enough = max(walked.values()) * (1 - TOLERANCE)
    return LookupChoice(next(size for size, value in walked.items() if value >= enough), walked)


def _text_ends(text: list[int]) -> list[int]:
    """Per row, the index just past the last row of its text (a text's rows follow each other)."""
    ends = [len(text)] * len(text)
    for row in range(len(text) - 2, -1, -1):
        ends[row] = ends[row + 1] if text[row + 1] == text[row] else row + 1
    return ends


def calibrate_lookup(head: EagleHead, batches: Sequence[Batch], depth: int = CHAIN_DEPTH) -> LookupChoice:
    """:func:`choose_min_match` over the response rows of the held-out ``batches``."""
    was_training = head.training
    head.eval()
    try:
        chains = RowChains.cat([row_chains(head, batch, depth) for batch in batches])
    finally:
        head.train(was_training)
    return choose_min_match(chains)
