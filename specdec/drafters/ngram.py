"""Prompt-lookup drafting: no model, continue the most recent earlier match of the context's tail.

The proposal is deterministic, so ``q`` is one-hot (DESIGN §3): the verifier accepts a token with
probability ``p(x)`` and draws a correction from ``p`` with ``x`` removed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdec.drafters.base import DraftConfig, Proposal
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree


def lookup_continuation(tokens: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Tokens that followed the most recent earlier occurrence of the longest matching tail.

    ``lookup_continuation([1, 2, 3, 9, 1, 2], 3, 1, 2) == [3, 9]``: the tail ``1 2`` occurred at
    position 0 and was followed by ``3 9``.
    """
    for size in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        tail = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start : start + size] == tail:
                follow = start + size
                return tokens[follow : follow + max_tokens]
    return []


@dataclass
class _Sequence:
    tokens: list[int] = field(default_factory=list)


class NgramDrafter:
    """Model-free chains from n-gram matches over prompt + output."""

    def __init__(self, config: DraftConfig, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.config = config
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._sequences: dict[int, _Sequence] = {}
        self._handles = itertools.count()

    def open(self, prompt: list[int], params: SamplingParams, generator: torch.Generator) -> int:
        handle = next(self._handles)
        self._sequences[handle] = _Sequence(list(prompt))
        return handle

    def propose(self, handles: list[int], max_tokens: list[int]) -> list[Proposal]:
        proposals = []
        for handle, budget in zip(handles, max_tokens, strict=True):
            limit = min(budget, self.config.num_draft_tokens)
            tokens = self._sequences[handle].tokens
            draft = lookup_continuation(tokens, self.max_ngram, self.min_ngram, limit) if limit > 0 else []
            proposals.append(Proposal(TokenTree.chain(draft), None))
        return proposals

    def commit(self, handle: int, accepted_path: list[int], emitted: list[int]) -> None:
        self._sequences[handle].tokens.extend(emitted)

    def close(self, handle: int) -> None:
        self._sequences.pop(handle, None)

    @property
    def num_open(self) -> int:
        return len(self._sequences)
