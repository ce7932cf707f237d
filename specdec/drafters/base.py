"""What every drafter promises: per-sequence state, batched proposals, rollback on commit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from specdec.errors import InvalidArgumentError
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree

TreeSampling = Literal["iid", "without_replacement"]


@dataclass(frozen=True)
class DraftConfig:
    """Shape of the candidates a drafter proposes each round.

    ``num_draft_tokens`` is the chain length γ, and the tree depth when ``tree_width > 1``.
    ``tree_budget`` caps the number of tree nodes (0: ``tree_width * num_draft_tokens``).
    ``draft_top_k`` truncates the draft distribution so ``q`` has small, exact support (DESIGN §5).
    """

    num_draft_tokens: int = 4
    tree_width: int = 1
    tree_budget: int = 0
    draft_top_k: int = 20
    tree_sampling: TreeSampling = "without_replacement"

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise InvalidArgumentError("num_draft_tokens", f"must be >= 1, got {self.num_draft_tokens}")
        if self.tree_width < 1:
            raise InvalidArgumentError("tree_width", f"must be >= 1, got {self.tree_width}")
        if self.tree_budget < 0:
            raise InvalidArgumentError("tree_budget", f"must be >= 0, got {self.tree_budget}")
        if self.draft_top_k < 0:
            raise InvalidArgumentError("draft_top_k", f"must be >= 0 (0: untruncated), got {self.draft_top_k}")
        if self.tree_sampling not in ("iid", "without_replacement"):
            raise InvalidArgumentError("tree_sampling", f"must be iid or without_replacement, got {self.tree_sampling}")

    @property
    def max_nodes(self) -> int:
        return self.tree_budget or self.tree_width * self.num_draft_tokens


@dataclass(frozen=True)
class Proposal:
    """Candidates for one sequence.

    ``draft_probs`` [N, V]: row i is the distribution node i was sampled from; ``None`` means the
    proposal is deterministic (model-free lookup, or greedy drafting) and ``q`` is one-hot per node.
    ``scheme`` says how siblings were drawn, which decides the tree acceptance rule.
    """

    tree: TokenTree
    draft_probs: torch.Tensor | None
    scheme: TreeSampling = "iid"


class Drafter(Protocol):
    """Per-sequence drafting state; all calls for many sequences are batched where the drafter can."""

    def open(self, prompt: list[int], params: SamplingParams, generator: torch.Generator) -> int:
        """Start a sequence on ``prompt`` and return its handle."""
        ...

    def propose(self, handles: list[int], max_tokens: list[int]) -> list[Proposal]:
        """Draft for each handle at most ``max_tokens[i]`` nodes (0: propose nothing)."""
        ...

    def commit(self, handle: int, accepted_path: list[int], emitted: list[int]) -> None:
        """The verifier accepted ``accepted_path`` of the last proposal and emitted ``emitted``."""
        ...

    def close(self, handle: int) -> None:
        """Free everything the sequence holds."""
        ...
