"""Drafting with a causal LM: a small draft model, or the target's first layers (early exit).

Per sequence the draft runner's KV holds a prefix of the text (prompt + committed + assumed); the rest,
at least the last token, is *pending* input of the next forward. A round drafts level by level; each level
is one batched forward over ``pending + tree so far``, so the last forward of a round leaves KV for every
node but the deepest level in the runner's scratch.

When the text moves on (commit, assume, sync; see :mod:`specdec.drafters.base`):

- if it extends the text the proposal was drafted from, the pending tokens and the accepted nodes that
  went through the last forward are committed by :meth:`KVRunner.commit` (pointer arithmetic for chains);
  accepted nodes of the deepest level, and a recovered or bonus token, never went through the draft model
  and become pending;
- otherwise (a rollback of an assumed chain) the runner is truncated to the common prefix, pointer
  arithmetic, and the new tokens become pending.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specdec.drafters.base import (
    DraftConfig,
    Outstanding,
    Proposal,
    Rejection,
    SequenceDrafter,
    SequenceState,
    StopCheck,
    common_prefix_length,
    likely_rejections,
    match_path,
    most_probable_leaf_path,
)
from specdec.errors import InvalidArgumentError
from specdec.runner import ForwardItem, KVRunner
from specdec.sampling import SamplingParams, argmax, logits_to_probs
from specdec.tree import ROOT, TokenTree, grown_dynamically


@dataclass(frozen=True)
class _Drafted(Outstanding):
    """An outstanding proposal and how many of its nodes (a topological prefix) are in the runner's scratch.

    ``forwarded_nodes`` is None when no forward ran for it (nothing was drafted). ``scratch_nodes``: each node's
    index in the forwarded tree, when :meth:`TreeDraft.select` kept only some of its nodes (None: the same).
    """

    forwarded_nodes: int | None = None
    scratch_nodes: tuple[int, ...] | None = None


@dataclass(kw_only=True)
class SampledSequence(SequenceState):
    """A drafting model's sequence: the request's sampling settings and the random stream children are drawn from."""

    params: SamplingParams
    generator: torch.Generator


@dataclass(kw_only=True)
class _Sequence(SampledSequence):
    runner_seq: int


@dataclass
class TreeDraft:
    """One sequence's tree under construction; ``levels`` is its depth limit this round.

    ``sequence`` is any drafter's sequence state with ``config``, ``params`` and ``generator``. ``corrections``
    (multi-outcome pre-drafting only): per expanded node, the draft's most probable token that is not one of its
    children, and that token's ranking probability. ``stopped``: the drafting was stopped before it finished.
    """

    sequence: SampledSequence
    budget: int
    levels: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    frontier: list[int] = field(default_factory=lambda: [ROOT])
    forwarded_nodes: int | None = None
    corrections: dict[int, tuple[int, float]] = field(default_factory=dict)
    stopped: bool = False

    def __post_init__(self) -> None:
        if self.dynamic:  # ``budget`` nodes hold at most ``budget`` levels: drafting deeper would be thrown away
            self.levels = min(self.levels, self.budget)

    @property
    def tree(self) -> TokenTree:
        return TokenTree(tuple(self.tokens), tuple(self.parents))

    @property
    def dynamic(self) -> bool:
        """Grown as EAGLE-2's dynamic tree (greedy trees only): every level expands the ``tree_width`` most probable
        nodes of the level above with ``tree_width`` children each, to the full depth, and :meth:`select` then keeps
        the ``budget`` most probable nodes of them all. The budget goes where the draft is confident: a deep chain
        where it is sure, a wide first level where it is not. Sampled children cannot be chosen after they are
        drawn (the kept ones would no longer be draws from ``q``), so a sampled tree spends its budget level by
        level as it grows."""
        return grown_dynamically(self.sequence.config.tree_width, self.sequence.params.greedy)

    @property
    def most_forwarded(self) -> int:
        """At most how many nodes go through a draft forward: ``budget``, or a dynamic tree's frontiers."""
        return max(self.budget, self.sequence.config.tree_width * self.levels) if self.dynamic else self.budget

    @property
    def growing(self) -> bool:
        """Whether another level may be added (the depth limit aside)."""
        return bool(self.frontier) and not self.stopped and (self.dynamic or len(self.tokens) < self.budget)

    def select(self) -> list[int] | None:
        """Keep a dynamic tree's ``budget`` nodes of highest path probability, numbered by it: node i is the tree's
        (i+1)-th most probable (ties: the lower index first). Returns the old index of each node kept, in the new
        order; None when every node stays where it is (a sampled tree always does: it spends its budget as it grows).

        A child's path probability is its parent's times its own rank (at most 1), and a parent's index is the lower,
        so the nodes kept are a tree and every parent comes before its children. Numbered so, the tree a smaller budget
        keeps is this one's first nodes (the candidates do not depend on the budget), which lets a controller price a
        dynamic tree node by node (:class:`specdec.adaptive.RankTracker`). A kept node's correction (pre-drafting's
        guess of what the target emits when it rejects every child) becomes its most probable dropped child, where
        it lost one: the draft's likeliest token that is not a child now. A dynamic tree is greedy: it has no rows."""
        if not self.dynamic:
            return None
        kept = sorted(range(len(self.tokens)), key=lambda node: -self.path_probs[node])[: self.budget]  # stable sort
        if kept == list(range(len(self.tokens))):
            return None
        new_index = {old: new for new, old in enumerate(kept)} | {ROOT: ROOT}
        corrections = dict(self.corrections)
        for old, parent in enumerate(self.parents):
            reach = path_prob(self, parent)
            if old in new_index or parent not in new_index or parent not in corrections or reach <= 0:
                continue
            rank = self.path_probs[old] / reach
            if rank > corrections[parent][1]:
                corrections[parent] = (self.tokens[old], rank)
        self.tokens = [self.tokens[old] for old in kept]
        self.parents = [new_index[self.parents[old]] for old in kept]
        self.path_probs = [self.path_probs[old] for old in kept]
        self.corrections = {new_index[node]: guess for node, guess in corrections.items() if node in new_index}
        self.frontier = []
        return kept

    def outstanding_fields(self) -> tuple[tuple[int, ...], tuple[Rejection, ...]]:
        """The finished tree's assumed path and the rejection verdicts a pre-draft after it prepares for."""
        tree = self.tree
        path = most_probable_leaf_path(tree, self.path_probs)
        count = self.sequence.config.predraft_outcomes - 1
        return tuple(path), likely_rejections(tree, path, self.path_probs, self.corrections, count)


class ModelDrafter(SequenceDrafter[_Sequence]):
    """Chains (``tree_width == 1``) or trees drafted by ``runner``'s model; batched across sequences."""

    def __init__(self, runner: KVRunner, config: DraftConfig) -> None:
        super().__init__(config, runner.vocab_size)
        self.runner = runner

    @property
    def runner_sequences(self) -> int:
        return self.runner.num_open

    def cached_length(self, handle: int) -> int:
        """Positions of the text whose KV is committed in the runner (at most ``len(text) - 1``)."""
        return self.runner.length(self._sequence(handle).runner_seq)

    def propose(self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None) -> list[Proposal]:
        """Draft level by level, one batched forward per level over every sequence still growing.

        A sequence drafts at most as deep as the runner's context allows; at its end it proposes nothing. A handle
        ``stop`` names before a level's forward stops there (empty proposal, nothing outstanding).
        """
        drafts = []
        for sequence, budget in zip(self._sequences_for(handles, max_tokens), max_tokens, strict=True):
            room = self.runner.max_seq_len + 1 - len(sequence.text)  # a level-d forward needs len(text) + d positions
            levels = max(0, min(sequence.config.num_draft_tokens, room))
            drafts.append(TreeDraft(sequence, min(budget, sequence.config.max_nodes), levels))
        for depth in range(max((draft.levels for draft in drafts), default=0)):
            mark_stopped(drafts, handles, stop)
            growing = [d for d in drafts if depth < d.levels and d.growing]
            if not growing:
                break
            items = [ForwardItem(d.sequence.runner_seq, self._pending(d.sequence), d.tree) for d in growing]
            for draft, logits in zip(growing, self.runner.forward(items), strict=True):
                draft.forwarded_nodes = len(draft.tokens)
                grow_level(draft, logits[[node + 1 for node in draft.frontier]], levels_left=draft.levels - depth)
        proposals = []
        for draft in drafts:
            if draft.stopped:
                proposals.append(Proposal(TokenTree.empty(), None))
                continue
            kept = draft.select()
            assumed, rejections = draft.outstanding_fields()
            draft.sequence.outstanding = _Drafted(
                draft.tree, assumed, rejections, draft.forwarded_nodes, None if kept is None else tuple(kept)
            )
            proposals.append(draft_proposal(draft, assumed, rejections))
        return proposals

    def _pending(self, sequence: _Sequence) -> list[int]:
        """The text after the runner's committed KV: the next forward's first input (never empty)."""
        return sequence.text[self.runner.length(sequence.runner_seq) :]

    def _start(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config: DraftConfig
    ) -> _Sequence:
        """Open a runner sequence and prefill all but the last prompt token (each round recomputes only that)."""
        if len(prompt) > self.runner.max_seq_len:
            raise InvalidArgumentError(
                "prompt", f"{len(prompt)} tokens exceed the draft model's context of {self.runner.max_seq_len}"
            )
        runner_seq = self.runner.open()
        try:
            if len(prompt) > 1:
                self.runner.forward([ForwardItem(runner_seq, prompt[:-1])])
                self.runner.commit(runner_seq, len(prompt) - 1)
        except BaseException:
            self.runner.close(runner_seq)
            raise
        return _Sequence(text=prompt, config=config, runner_seq=runner_seq, params=params, generator=generator)

    def _resync(self, state: _Sequence, text: list[int], path: list[int] | None) -> None:
        drafted, state.outstanding = state.outstanding, None
        seq, old = state.runner_seq, state.text
        if isinstance(drafted, _Drafted) and drafted.forwarded_nodes is not None and text[: len(old)] == old:
            # the text extends the one the proposal hangs off: keep the last forward's pending and accepted nodes
            path = match_path(drafted.tree, text[len(old) :]) if path is None else path
            scratch = drafted.scratch_nodes or range(len(drafted.tree))
            in_cache = [scratch[node] for node in path if scratch[node] < drafted.forwarded_nodes]  # a prefix
            self.runner.commit(seq, len(old) - self.runner.length(seq), in_cache)
            agree = len(text)  # the committed KV now holds a prefix of the new text
        else:
            agree = common_prefix_length(old, text)  # the committed KV holds a prefix of the old text
        length = self.runner.length(seq)
        keep = min(length, agree, len(text) - 1)  # the last token stays pending: the next forward's input
        if keep < length:
            self.runner.truncate(seq, keep)
        state.text = text

    def _release(self, state: _Sequence) -> None:
        self.runner.close(state.runner_seq)

    def _detached(self, outstanding: Outstanding) -> Outstanding:
        """Its nodes' KV is no longer in the runner's scratch: a commit of it recomputes them as pending input."""
        return replace(outstanding, forwarded_nodes=None) if isinstance(outstanding, _Drafted) else outstanding


def mark_stopped(drafts: list[TreeDraft], handles: list[int], stop: StopCheck | None) -> None:
    """Mark ``stopped`` the drafts (``drafts[i]`` is ``handles[i]``'s) whose handle ``stop`` names now."""
    if stop is not None:
        for draft, handle in zip(drafts, handles, strict=True):
            draft.stopped = draft.stopped or stop(handle)


@dataclass(frozen=True)
class DraftVocabulary:
    """The target ids ``ids`` (ascending, [K]) a drafter's logits columns stand for, of a target vocabulary of
    ``size``: outside them q is 0. Drawing and ranking children over the K columns instead of over rows widened to
    the target's vocabulary gives the same children and q (every other token's probability is 0) at K / V of the
    cost: an EAGLE head's K = 8 192 of SmolLM2's 49 152 made a draft level's children 1.35 ms there."""

    ids: torch.Tensor
    size: int

    def tokens(self, columns: list[int]) -> list[int]:
        return self.ids[columns].tolist()

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` [K] as a row over the target's vocabulary [V]."""
        return q.new_zeros(self.size).index_copy_(0, self.ids, q)


def grow_level(
    draft: TreeDraft, frontier_logits: torch.Tensor, levels_left: int, vocab: DraftVocabulary | None = None
) -> None:
    """Add one level of children under the frontier; ``frontier_logits`` [F, V] (one row per node of
    ``draft.frontier``, in its order), or [F, K] over ``vocab``'s columns.

    The most probable frontier nodes (by draft path probability) are expanded first, so the
    node budget goes where acceptance is likeliest; each level gets at most its share of the
    remaining budget (``room // levels_left``, at least one node), so the tree reaches the
    configured depth: width 2, depth 3, budget 6 gives two children at every level, under
    the most probable node of the level above. A dynamic tree (:attr:`TreeDraft.dynamic`) instead gives every
    frontier node ``tree_width`` children and keeps the ``tree_width`` most probable of them as the next frontier;
    its budget is spent afterwards, by :meth:`TreeDraft.select`.
    """
    sequence = draft.sequence
    config = sequence.config
    order = sorted(range(len(draft.frontier)), key=lambda index: -path_prob(draft, draft.frontier[index]))
    expand = [draft.frontier[index] for index in order]
    node_logits = frontier_logits[order].float()  # [F, V or K]
    # On the host: children are drawn with the sequence's CPU generator, and the rows go over the wire. Greedy
    # children are the top tokens, and a greedy proposal carries no rows (q is one-hot): it needs no q.
    if sequence.params.greedy:
        rows, ranking = None, torch.softmax(node_logits, dim=-1).cpu()
    else:
        rows = ranking = logits_to_probs(node_logits, sequence.params.with_top_k_cap(config.draft_top_k)).cpu()
    predrafting = config.predraft_outcomes > 1
    new_frontier = []
    level_room = max(1, (draft.budget - len(draft.tokens)) // levels_left)
    for index, (node, row_logits, rank) in enumerate(zip(expand, node_logits, ranking, strict=True)):
        count = config.tree_width
        if not draft.dynamic:
            count = min(count, level_room, draft.budget - len(draft.tokens))
        if count <= 0:
            break
        q = rows[index] if rows is not None else None
        columns = draw_children(row_logits, q, count, sequence)
        level_room -= len(columns)
        children = vocab.tokens(columns) if vocab is not None else columns
        if predrafting:
            others = rank.clone()
            others[columns] = 0
            if float(others.max()) > 0:
                correction = int(argmax(others))
                token = vocab.tokens([correction])[0] if vocab is not None else correction
                draft.corrections[node] = (token, float(others.max()))
        if q is not None:
            draft.rows += [vocab.widen(q) if vocab is not None else q] * len(children)
        for column, token in zip(columns, children, strict=True):
            draft.tokens.append(token)
            draft.parents.append(node)
            draft.path_probs.append(path_prob(draft, node) * float(rank[column]))
            new_frontier.append(len(draft.tokens) - 1)
    if draft.dynamic:  # the next level expands this level's most probable nodes
        new_frontier = sorted(new_frontier, key=lambda node: -draft.path_probs[node])[: config.tree_width]
    draft.frontier = new_frontier


def path_prob(draft: TreeDraft, node: int) -> float:
    return 1.0 if node == ROOT else draft.path_probs[node]


def draw_children(row_logits: torch.Tensor, q: torch.Tensor | None, count: int, sequence: SampledSequence) -> list[int]:
    """``count`` children of one node (column indices); ``row_logits``, ``q``: [V] (or [K]).

    Greedy: the top-``count`` draft tokens (deterministic children are lossless only under
    greedy, DESIGN §3). Sampling: drawn from ``q`` by the sequence's tree scheme.
    """
    if q is None:  # greedy
        return torch.topk(row_logits, count).indices.tolist()
    # Drawn among q's nonzero entries, which is drawing from q: torch's multinomial scans the whole row it is given
    # (~2.3 ms for 49 152 tokens here), and q, truncated to draft_top_k tokens, is nearly all zeros.
    support = torch.nonzero(q).squeeze(1)
    without_replacement = sequence.config.tree_sampling == "without_replacement"
    if without_replacement:
        count = min(count, len(support))
    drawn = torch.multinomial(q[support], count, replacement=not without_replacement, generator=sequence.generator)
    return support[drawn].tolist()


def draft_proposal(draft: TreeDraft, assumed: tuple[int, ...], rejections: tuple[Rejection, ...]) -> Proposal:
    """The finished tree with its draft rows (none under greedy: ``q`` is one-hot), assumed path and rejections."""
    if draft.sequence.params.greedy:
        return Proposal(draft.tree, None, "iid", assumed, rejections)
    probs = torch.stack(draft.rows) if draft.rows else None
    return Proposal(draft.tree, probs, draft.sequence.config.tree_sampling, assumed, rejections)
