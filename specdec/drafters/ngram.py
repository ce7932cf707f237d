"""Prompt-lookup drafting: no model, continue the most recent earlier match of the context's tail.

The proposal is deterministic, so ``q`` is one-hot (DESIGN §3): the verifier accepts a token with
probability ``p(x)`` and draws a correction from ``p`` with ``x`` removed.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftConfig, Outstanding, Proposal, SequenceDrafter, SequenceState, StopCheck
from specdec.lookup import lookup_continuation
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree


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
