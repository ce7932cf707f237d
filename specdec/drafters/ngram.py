"""Prompt-lookup drafting: no model, continue the most recent earlier match of the context's tail.

The proposal is deterministic, so ``q`` is one-hot (DESIGN §3): the verifier accepts a token with
probability ``p(x)`` and draws a correction from ``p`` with ``x`` removed.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftConfig, Outstanding, Proposal, SequenceDrafter, SequenceState, StopCheck
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree


def lookup_continuation(tokens: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching tail (at most ``max_ngram``
    tokens, at least ``min_ngram``).

    ``lookup_continuation([1, 2, 3, 9, 1, 2], 3, 1, 2) == [3, 9]``: the tail ``1 2`` occurred at
    position 0 and was followed by ``3 9``. One pass over the text finds the places the last token occurred, and
    only those are extended backwards: a long text costs one comparison per token, not one per token and tail size.
    """
    size = len(tokens)
    if min_ngram < 1 or size < min_ngram + 1:
        return []
    last = tokens[-1]
    best_length, best_end = 0, -1
    for end in range(size - 1, min_ngram - 1, -1):  # a match ends at ``end`` (exclusive), most recent first
        if tokens[end - 1] != last:
            continue
        length = 1
        limit = min(max_ngram, end)
        while length < limit and tokens[end - 1 - length] == tokens[size - 1 - length]:
            length += 1
        if length > best_length:
            best_length, best_end = length, end
            if length == max_ngram:
                break
    if best_length < min_ngram:
        return []
    return tokens[best_end : best_end + max_tokens]


class NgramDrafter(SequenceDrafter[SequenceState]):
    """Model-free chains from n-gram matches over the text (prompt + committed + assumed).

    The text is the whole state, so commit, assume and rollback only rewrite it.
    """

    def __init__(
        self, config: DraftConfig, max_ngram: int = 3, min_ngram: int = 1, *, vocab_size: int | None = None
    ) -> None:
        super().__init__(config, vocab_size)
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None) -> list[Proposal]:
        """Chains by lookup (one step, nothing to stop)."""
        proposals = []
        for state, budget in zip(self._sequences_for(handles, max_tokens), max_tokens, strict=True):
            limit = min(budget, state.config.num_draft_tokens)
            draft = lookup_continuation(state.text, self.max_ngram, self.min_ngram, limit) if limit > 0 else []
            tree = TokenTree.chain(draft)
            state.outstanding = Outstanding(tree, tuple(range(len(tree))))
            proposals.append(Proposal(tree, None, "iid", tuple(range(len(tree))), model_free=True))
        return proposals

    def _start(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config: DraftConfig
    ) -> SequenceState:
        return SequenceState(text=prompt, config=config)

    def _resync(self, state: SequenceState, text: list[int], path: list[int] | None) -> None:
        state.text, state.outstanding = text, None
