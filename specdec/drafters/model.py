"""Drafting with a causal LM: a small draft model, or the target's first layers (early exit).

Per sequence the draft runner's KV holds only committed text. A round drafts level by level;
each level is one batched forward over ``pending + tree so far``, so the last forward of a round
leaves KV for every node but the deepest level in the runner's scratch. On commit the accepted
nodes that went through that forward are kept by :meth:`KVRunner.commit` (pointer arithmetic for
chains); accepted nodes of the deepest level, and the correction or bonus token, never went
through the draft model and become the next round's pending input.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdec.drafters.base import DraftConfig, Proposal
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.tree import ROOT, TokenTree


@dataclass
class _Sequence:
    runner_seq: int
    pending: list[int]
    params: SamplingParams
    generator: torch.Generator
    forwarded_nodes: int | None = None  # nodes that went through the last forward; None: no forward since commit


@dataclass
class _Draft:
    """One sequence's tree under construction."""

    sequence: _Sequence
    budget: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    frontier: list[int] = field(default_factory=lambda: [ROOT])

    @property
    def tree(self) -> TokenTree:
        return TokenTree(tuple(self.tokens), tuple(self.parents))


class ModelDrafter:
    """Chains (``tree_width == 1``) or trees drafted by ``runner``'s model; batched across sequences."""

    def __init__(self, runner: KVRunner, config: DraftConfig) -> None:
        self.runner = runner
        self.config = config
        self._sequences: dict[int, _Sequence] = {}
        self._handles = itertools.count()

    def open(self, prompt: list[int], params: SamplingParams, generator: torch.Generator) -> int:
        runner_seq = self.runner.open()
        if len(prompt) > 1:  # prefill now so each round recomputes only the last token(s)
            self.runner.forward([ForwardItem(runner_seq, prompt[:-1])])
            self.runner.commit(runner_seq, len(prompt) - 1)
        handle = next(self._handles)
        self._sequences[handle] = _Sequence(runner_seq, prompt[-1:], params, generator)
        return handle

    def propose(self, handles: list[int], max_tokens: list[int]) -> list[Proposal]:
        drafts = {
            handle: _Draft(self._sequences[handle], min(budget, self.config.max_nodes))
            for handle, budget in zip(handles, max_tokens, strict=True)
        }
        for depth in range(self.config.num_draft_tokens):
            growing = [draft for draft in drafts.values() if draft.frontier and len(draft.tokens) < draft.budget]
            if not growing:
                break
            items = [ForwardItem(d.sequence.runner_seq, d.sequence.pending, d.tree) for d in growing]
            for draft, logits in zip(growing, self.runner.forward(items), strict=True):
                draft.sequence.forwarded_nodes = len(draft.tokens)
                self._grow(draft, logits, last_level=depth == self.config.num_draft_tokens - 1)
        return [self._proposal(drafts[handle]) for handle in handles]

    def _grow(self, draft: _Draft, logits: torch.Tensor, last_level: bool) -> None:
        """Add one level of children under the frontier; ``logits`` [1 + N, V] from the forward.

        The most probable frontier nodes (by draft path probability) are expanded first, so the
        node budget goes where acceptance is likeliest.
        """
        sequence = draft.sequence
        expand = sorted(draft.frontier, key=lambda node: -self._path_prob(draft, node))
        node_logits = logits[[node + 1 for node in expand]]  # [F, V]
        rows = logits_to_probs(node_logits, sequence.params.with_top_k_cap(self.config.draft_top_k))
        ranking = torch.softmax(node_logits.float(), dim=-1) if sequence.params.greedy else rows
        new_frontier = []
        for node, row_logits, q, rank in zip(expand, node_logits, rows, ranking, strict=True):
            room = draft.budget - len(draft.tokens)
            if room <= 0:
                break
            for token in self._children(row_logits, q, min(self.config.tree_width, room), sequence):
                draft.tokens.append(token)
                draft.parents.append(node)
                draft.rows.append(q)
                draft.path_probs.append(self._path_prob(draft, node) * float(rank[token]))
                new_frontier.append(len(draft.tokens) - 1)
        draft.frontier = [] if last_level else new_frontier

    @staticmethod
    def _path_prob(draft: _Draft, node: int) -> float:
        return 1.0 if node == ROOT else draft.path_probs[node]

    def _children(self, row_logits: torch.Tensor, q: torch.Tensor, count: int, sequence: _Sequence) -> list[int]:
        """``count`` children of one node; ``row_logits``, ``q``: [V].

        Greedy: the top-``count`` draft tokens (deterministic children are lossless only under
        greedy, DESIGN §3). Sampling: drawn from ``q`` by the configured tree scheme.
        """
        if sequence.params.greedy:
            return torch.topk(row_logits, count).indices.tolist()
        if self.config.tree_sampling == "without_replacement":
            count = min(count, int((q > 0).sum()))
            return torch.multinomial(q, count, replacement=False, generator=sequence.generator).tolist()
        return torch.multinomial(q, count, replacement=True, generator=sequence.generator).tolist()

    def _proposal(self, draft: _Draft) -> Proposal:
        if draft.sequence.params.greedy:
            return Proposal(draft.tree, None)
        probs = torch.stack(draft.rows) if draft.rows else None
        return Proposal(draft.tree, probs, self.config.tree_sampling)

    def commit(self, handle: int, accepted_path: list[int], emitted: list[int]) -> None:
        sequence = self._sequences[handle]
        if sequence.forwarded_nodes is None:
            sequence.pending = sequence.pending + list(emitted)
            return
        in_cache = [node for node in accepted_path if node < sequence.forwarded_nodes]
        self.runner.commit(sequence.runner_seq, len(sequence.pending), in_cache)
        sequence.pending = list(emitted[len(in_cache) :])
        sequence.forwarded_nodes = None

    def close(self, handle: int) -> None:
        sequence = self._sequences.pop(handle, None)
        if sequence is not None:
            self.runner.close(sequence.runner_seq)

    @property
    def num_open(self) -> int:
        return len(self._sequences)
