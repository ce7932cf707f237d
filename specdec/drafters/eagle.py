"""Drafting with an EAGLE head (:mod:`specdec.drafters.eagle_head`) from the target's own features.

Per sequence the drafter holds the text, the target's **true** feature rows ``F_0 .. F_(L-1)`` (given by
:meth:`EagleDrafter.add_features`, from the verifier's outcomes) and the head's KV of head positions
``1 .. c``, each computed from a true feature (``c <= L``). Head position ``i`` reads ``(t_i, F_(i-1))``.

A round on a text of ``n`` tokens:

1. one batched forward over the *pending* head positions ``c+1 .. n-1``; its last row's prediction ``g_(n-1)``
   gives the first level of children (text position ``n``);
2. one forward per further level over the frontier, each node reading its parent's prediction ``g`` (RoPE at
   ``n + depth``, attention over the committed head KV, the pending rows and the node's ancestors);
3. the pending rows read from true features go into the head's KV (they never change); everything else was
   scratch.

A row's *prediction* ``g`` is its state (:meth:`~specdec.drafters.eagle_head.EagleHead.forward_rows`: the predicted
``F`` of an EAGLE-1 head, the pre-norm ``h`` of an EAGLE-3 one). A position with no true feature uses the head's own
prediction for it: that is how a chain pre-drafted on an assumed path (pipelining, :meth:`assume_accepted`)
drafts, from the predictions made while drafting that path. With neither (a sequence just opened: the verifier
has not yet prefilled the prompt) the drafter proposes nothing, and that round is a plain target step. When the
text is rolled back, features, predictions and head KV beyond the common prefix are dropped: pointer arithmetic
on ``L`` and ``c``.

**Prompt lookup.** Code edits, rewrites and quotations copy their prompt, where the text's own tail predicts the
next tokens better than any head. A round whose text ends in a few tokens that occurred before proposes what
followed them (as :class:`~specdec.drafters.ngram.NgramDrafter` does, with a longer required match) and runs no head
forward; every other round drafts with the head. Which one a round uses depends on the text alone, and a lookup
chain is deterministic (``q`` one-hot), so the output law is unchanged (DESIGN §3). The head's pending rows simply
wait for its next round; a chain pre-drafted on an assumed lookup chain has no predicted features, so it is a
lookup chain or nothing. Measured in ``bench/results/eagle-lookup.md``.

**Context.** A round attends over the head KV of at most the last ``context`` head positions of its text
(:data:`~specdec.drafters.eagle_head.HEAD_CONTEXT` by default: the span ``specdec distill`` trains a head on), plus
its own pending rows and nodes. The target's features already carry the whole text; the head's own attention
only refines them, and was never trained over longer spans. So a long prompt costs its first draft a forward
over ``context`` rows, not over the whole prompt (on this CPU, one thread, 2 560 tokens: 0.11 s, not 0.61 s),
and the rows before the window are never computed: they stay below ``kv_floor``, and their features unprojected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.attention_masks import attention_mask
from specdec.drafters.base import (
    DraftConfig,
    Outstanding,
    Proposal,
    SequenceDrafter,
    StopCheck,
    common_prefix_length,
)
from specdec.drafters.eagle_head import HEAD_CONTEXT, EagleHead, load_head, scaled_attention
from specdec.drafters.model import (
    DraftVocabulary,
    SampledSequence,
    TreeDraft,
    draft_proposal,
    grow_level,
    mark_stopped,
)
from specdec.errors import InvalidArgumentError
from specdec.linear import can_quantize, packed_for_inference
from specdec.lookup import DEFAULT_LOOKUP_MIN_MATCH, LookupIndex
from specdec.precision import check_draft_quantization
from specdec.sampling import SamplingParams
from specdec.tree import ROOT, TokenTree


@dataclass(frozen=True, kw_only=True)
class _Drafted(Outstanding):
    """An outstanding proposal with the head's predictions: ``root_prediction`` at the text's last token and
    one per node that went through a forward (``None`` for the deepest level)."""

    base_length: int
    root_prediction: torch.Tensor | None
    node_predictions: tuple[torch.Tensor | None, ...]


@dataclass(kw_only=True)
class _Sequence(SampledSequence):
    keys: list[torch.Tensor]  # per layer [kv_heads, capacity, head_dim]: head positions 1 .. committed
    values: list[torch.Tensor]
    committed: int = 0  # head positions with KV (1 .. committed), each read from a true feature
    kv_floor: int = 0  # KV rows below it were never computed (before every window since): kv_floor <= committed
    features: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [capacity, hidden]
    num_features: int = 0  # true features F_(features_from) .. F_(num_features - 1)
    features_from: int = 0  # rows before it were not sent (older than the context) or were dropped
    fresh_from: int | None = None  # rows from here on were given since the last resync: for the text that comes
    predicted: dict[int, torch.Tensor] = field(default_factory=dict)  # text position -> the head's g there
    lookup: LookupIndex | None = None  # the text, indexed for prompt lookup (None: the drafter never looks up)


@dataclass
class _Round:
    """One sequence's draft this round: the tree, the pending rows, and the predictions made."""

    draft: TreeDraft
    pending_tokens: list[int]
    pending_features: list[torch.Tensor]
    true_pending: int  # leading pending rows read from true features (committed to KV after the round)
    visible_from: int  # the committed KV rows it attends to: visible_from .. kv_end - 1
    kv_end: int  # the KV row of its first pending row (past ``committed`` when older rows fell out of the window)
    scratch: int = 0  # rows whose K/V this round wrote into the sequence's buffers from ``kv_end`` on
    root_prediction: torch.Tensor | None = None
    node_predictions: list[torch.Tensor | None] = field(default_factory=list)
    forwarded: list[int] = field(default_factory=list)  # the nodes in the scratch after the pending rows, in order


@dataclass(frozen=True)
class _Slot:
    """One round's rows in a packed head forward: where they start, how many, and what they may attend to."""

    plan: _Round
    row: int
    size: int
    mask: torch.Tensor  # bool [size, committed + scratch + size]


class _PackedAttention:
    """Attention of packed rows, per sequence over its committed head KV, its round's scratch and its new rows: the
    new K/V are written into the sequence's buffers after the round's scratch, so what a row attends to is one view
    of them (copying the window out each level cost more than the attention)."""

    def __init__(self, slots: list[_Slot]) -> None:
        self.slots = slots

    def __call__(self, index: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        outputs = []
        for slot in self.slots:
            rows = slice(slot.row, slot.row + slot.size)
            plan, state = slot.plan, slot.plan.draft.sequence
            start = plan.kv_end + plan.scratch
            end = start + slot.size
            keys, values = state.keys[index], state.values[index]
            keys[:, start:end] = key[0, :, rows]
            values[:, start:end] = value[0, :, rows]
            visible = slice(plan.visible_from, end)
            outputs.append(
                scaled_attention(query[:, :, rows], keys[None, :, visible], values[None, :, visible], slot.mask)
            )
        return torch.cat(outputs, dim=2)


class EagleDrafter(SequenceDrafter[_Sequence]):
    """Chains or trees drafted by an EAGLE ``head``; batched across sequences (one forward per level). A round
    attends over the head KV of at most ``context`` head positions (see the module).

    ``quantization`` ``"int8"`` runs the layers a draft level goes through (the decoder layers and the LM head)
    over int8 weights (:class:`~specdec.linear.Int8Linear`; a float32 head on a CPU with torch's x86 quantized
    engine, or it is refused); ``"auto"`` does where that holds and runs the head as loaded elsewhere. q is computed
    from those layers, so the output law is unchanged and only acceptance can move. ``fc``, which reads the
    target's rows once a round, stays as it is.

    ``lookup_min_match`` > 0 makes a round whose text's last tokens (at least that many) occurred earlier in the text a
    **prompt-lookup** chain instead: what followed the longest such match, most recent first, up to the round's node
    budget (see the module).
    """

    def __init__(
        self,
        head: EagleHead,
        config: DraftConfig,
        context: int = HEAD_CONTEXT,
        quantization: str = "none",
        lookup_min_match: int = DEFAULT_LOOKUP_MIN_MATCH,
    ) -> None:
        super().__init__(config, head.vocab_size)
        if context < 1:
            raise InvalidArgumentError("context", f"must be >= 1, got {context}")
        if lookup_min_match < 0:
            raise InvalidArgumentError("lookup_min_match", f"must be >= 0 (0: never), got {lookup_min_match}")
        self.lookup_min_match = lookup_min_match
        quantizable = can_quantize(head.lm_head)
        if check_draft_quantization(quantization) == "int8" and not quantizable:
            weight = head.lm_head.weight
            raise InvalidArgumentError(
                "draft_quantization",
                f"int8 needs a float32 head on a CPU with torch's x86 quantized engine, not {weight.dtype} on "
                f"{weight.device} with {torch.backends.quantized.engine!r}",
            )
        int8 = ("layers", "lm_head") if quantization != "none" and quantizable else ()
        # float32 on CPU: oneDNN over prepacked weights, or int8 ones (specdec.linear)
        self.head = packed_for_inference(head, int8_children=int8)
        self.context = context
        self.max_seq_len = int(head.layer_config.max_position_embeddings)
        self._kv_heads = int(head.layer_config.num_key_value_heads)  # the head is never sharded
        self._head_dim = head.layers[0].self_attn.head_dim
        weight = head.embed_tokens.weight
        self._tensors = {"dtype": weight.dtype, "device": weight.device}  # of every row, KV and prediction held
        self._draft_vocab = DraftVocabulary(head.draft_to_target.cpu(), self.vocab_size)  # q rows: on the host

    @classmethod
    def load(
        cls,
        directory: Path,
        config: DraftConfig,
        *,
        hidden_size: int,
        vocab_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        context: int = HEAD_CONTEXT,
        quantization: str = "none",
        lookup_min_match: int | None = None,
    ) -> EagleDrafter:
        """The head stored in ``directory`` (checked against the target's sizes), its weights in ``dtype`` on
        ``device``, its draft layers ``quantization``, prompt lookup from ``lookup_min_match`` (see the class; None:
        the tail ``specdec distill`` chose for the head, or :data:`~specdec.lookup.DEFAULT_LOOKUP_MIN_MATCH` for a
        head without one).
        bfloat16 halves the bytes a draft step reads; the rotary frequencies stay float32, and q is always computed in
        float32 from the head's logits."""
        head, info = load_head(directory, hidden_size=hidden_size, vocab_size=vocab_size)
        if lookup_min_match is None:
            chosen = info.lookup_min_match
            lookup_min_match = DEFAULT_LOOKUP_MIN_MATCH if chosen is None else chosen
        head.to(device)
        for parameter in head.parameters():
            parameter.data = parameter.data.to(dtype)
        return cls(head, config, context, quantization, lookup_min_match)

    @property
    def feature_width(self) -> int:
        return self.head.feature_width

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    @property
    def feature_context(self) -> int:
        """A round reads the rows of the ``context`` positions before its text's last token; one more covers a
        text whose every token has KV (a deferred bonus), whose next token will read the last row."""
        return self.context + 1

    def add_features(self, handle: int, start: int, rows: torch.Tensor) -> None:
        """Store true features [R, feature_width] of positions ``start ..`` (as the head's input features,
        :meth:`~specdec.drafters.eagle_head.EagleHead.project`); they must continue (or overlap) what the sequence
        holds, or start a new run before the text's last token (a verifier sends the rows of the last
        :attr:`feature_context` positions, or fewer where they would outgrow a message; the rows held before the gap
        are dropped, and until the window has slid past the gap a round attends over fewer positions). They may run
        past the text by what one round commits: the rows of accepted nodes come before the commit that appends
        them."""
        state = self._sequence(handle)
        if rows.ndim != 2 or rows.shape[1] != self.feature_width:
            raise InvalidArgumentError("features", f"need rows of width {self.feature_width}, got {tuple(rows.shape)}")
        end = start + len(rows)
        gap = start > state.num_features
        if start < 0 or (gap and start >= len(state.text)) or end > len(state.text) + state.config.max_nodes:
            raise InvalidArgumentError(
                "features",
                f"rows {start}..{end - 1} neither continue the {state.num_features} held nor start before the last "
                f"token of a text of {len(state.text)}, or run past it by more than one round",
            )
        # rows older than any window can reach are never read: the text shrinks by at most an assumed path
        kept = start + min(max(len(state.text) - self.context - 1 - state.config.max_nodes - start, 0), len(rows))
        if end > state.features.shape[0]:
            grown = torch.empty(max(end, 2 * state.features.shape[0], 64), self.head.hidden_size, **self._tensors)
            if state.num_features > state.features_from:
                held = slice(state.features_from, state.num_features)
                grown[held] = state.features[held]
            state.features = grown
        with torch.inference_mode():
            state.features[kept:end] = self.head.project(rows[kept - start :].to(**self._tensors))
        if start < state.num_features and state.committed > start:  # re-sent rows: head KV read the old ones
            state.committed = start
            state.kv_floor = min(state.kv_floor, start)
        if gap or end < state.features_from:  # a run apart from the rows held: those are dropped
            state.features_from, state.num_features = kept, end
        else:
            state.features_from = min(state.features_from, kept)
            state.num_features = max(state.num_features, end)
        state.fresh_from = start if state.fresh_from is None else min(state.fresh_from, start)

    @torch.inference_mode()
    def propose(self, handles: list[int], max_tokens: list[int], stop: StopCheck | None = None) -> list[Proposal]:
        states = self._sequences_for(handles, max_tokens)
        lookups = [self._lookup(state, budget) for state, budget in zip(states, max_tokens, strict=True)]
        rounds = [
            None if lookup else self._plan(state, budget)
            for state, budget, lookup in zip(states, max_tokens, lookups, strict=True)
        ]
        planned = [(handle, plan) for handle, plan in zip(handles, rounds, strict=True) if plan is not None]
        drafts, planned_handles = [plan.draft for _, plan in planned], [handle for handle, _ in planned]
        mark_stopped(drafts, planned_handles, stop)
        growing = [plan for _, plan in planned if not plan.draft.stopped]
        if growing:
            self._forward_pending(growing)
            for depth in range(1, max(r.draft.levels for r in growing)):
                mark_stopped(drafts, planned_handles, stop)
                level = [r for r in growing if depth < r.draft.levels and r.draft.growing]
                if not level:
                    break
                self._forward_level(level, depth)
        proposals = []
        for state, plan, lookup in zip(states, rounds, lookups, strict=True):
            if lookup:
                tree, path = TokenTree.chain(lookup), tuple(range(len(lookup)))
                state.outstanding = _Drafted(
                    tree, path, base_length=len(state.text), root_prediction=None, node_predictions=(None,) * len(tree)
                )
                proposals.append(Proposal(tree, None, "iid", path, model_free=True))
                continue
            if plan is None:
                state.outstanding = _Drafted(
                    TokenTree.empty(), (), base_length=len(state.text), root_prediction=None, node_predictions=()
                )
                proposals.append(Proposal(TokenTree.empty(), None))
                continue
            draft = plan.draft
            if draft.stopped:  # nothing outstanding; its scratch is dropped
                proposals.append(Proposal(TokenTree.empty(), None))
                continue
            self._commit_true_rows(state, plan)
            predictions = plan.node_predictions + [None] * (len(draft.tokens) - len(plan.node_predictions))
            kept = draft.select()
            if kept is not None:
                predictions = [predictions[old] for old in kept]
            tree = draft.tree
            assumed, rejections = draft.outstanding_fields()
            state.outstanding = _Drafted(
                tree,
                assumed,
                rejections,
                base_length=len(state.text),
                root_prediction=plan.root_prediction,
                node_predictions=tuple(predictions),
            )
            proposals.append(draft_proposal(draft, assumed, rejections))
        return proposals

    def _lookup(self, state: _Sequence, budget: int) -> list[int]:
        """This round's chain by prompt lookup: what followed the most recent earlier occurrence of the text's tail,
        when that tail is at least ``lookup_min_match`` tokens long (else none: the head drafts)."""
        if state.lookup is None:
            return []
        limit = min(budget, state.config.max_nodes, self.max_seq_len - len(state.text))
        return state.lookup.prompt_lookup(self.lookup_min_match, limit)

    def _plan(self, state: _Sequence, budget: int) -> _Round | None:
        """This round's pending rows and depth, or None when the sequence cannot draft (no features yet)."""
        length = len(state.text)
        room = self.max_seq_len - length  # a depth-d node reads head position length + d - 1
        levels = max(0, min(state.config.num_draft_tokens, room))
        budget = min(budget, state.config.max_nodes)
        if length < 2 or levels == 0 or budget <= 0:
            return None
        # the window's first KV row (its head position - 1): the last `context`, of the positions with true rows
        window_start = max(length - 1 - self.context, state.features_from)
        first = max(state.committed, window_start) + 1  # head position of the first pending row
        if first >= length:  # no true row to draft from yet
            return None
        tokens, features = [], []
        for position in range(first, length):  # head position i reads (t_i, F_(i-1))
            feature = self._feature(state, position - 1)
            if feature is None:
                return None
            tokens.append(state.text[position])
            features.append(feature)
        kv_end = first - 1
        visible_from = kv_end if kv_end > state.committed else max(state.kv_floor, window_start)
        true_rows = max(0, min(length - 1, state.num_features) - kv_end)  # true features: a prefix
        draft = TreeDraft(state, budget, levels)
        self._reserve(state, kv_end + len(tokens) + draft.most_forwarded)  # the round's scratch: pending rows, nodes
        return _Round(draft, tokens, features, true_rows, visible_from, kv_end)

    def _reserve(self, state: _Sequence, size: int) -> None:
        """Room for ``size`` KV rows in the sequence's buffers (doubling: the only copy of committed KV)."""
        for buffers in (state.keys, state.values):
            for index, buffer in enumerate(buffers):
                if size > buffer.shape[1]:
                    grown = buffer.new_empty(buffer.shape[0], max(size, 2 * buffer.shape[1], 64), buffer.shape[2])
                    grown[:, state.kv_floor : state.committed] = buffer[:, state.kv_floor : state.committed]
                    buffers[index] = grown

    def _feature(self, state: _Sequence, position: int) -> torch.Tensor | None:
        if state.features_from <= position < state.num_features:
            return state.features[position]
        return state.predicted.get(position)

    def _forward_pending(self, rounds: list[_Round]) -> None:
        """Forward every round's pending rows; the last row's prediction grows the first level."""
        slots, tokens, features, positions = [], [], [], []
        for plan in rounds:
            size = len(plan.pending_tokens)
            mask = attention_mask(plan.kv_end - plan.visible_from, size, TokenTree.empty())
            slots.append(_Slot(plan, len(tokens), size, mask.to(self._tensors["device"])))
            tokens += plan.pending_tokens
            features += plan.pending_features
            positions += range(plan.kv_end + 1, plan.kv_end + 1 + size)
        predicted = self._run(slots, tokens, features, positions)
        for plan, slot in zip(rounds, slots, strict=True):
            plan.root_prediction = predicted[slot.row + slot.size - 1]
        self._grow(rounds, [[plan.root_prediction] for plan in rounds], [plan.draft.levels for plan in rounds])

    def _forward_level(self, rounds: list[_Round], depth: int) -> None:
        """Forward the frontier (nodes of depth ``depth - 1``), each reading its parent's prediction."""
        slots, tokens, features, positions = [], [], [], []
        for plan in rounds:
            draft = plan.draft
            state, frontier = draft.sequence, draft.frontier
            # the scratch's nodes and the frontier, as a tree of their own: a dynamic tree forwards only the nodes
            # it expands, and every ancestor of a frontier node was expanded
            order = plan.forwarded + frontier
            place = {node: index for index, node in enumerate(order)} | {ROOT: ROOT}
            rows = TokenTree(tuple(draft.tokens[n] for n in order), tuple(place[draft.parents[n]] for n in order))
            full = attention_mask(plan.kv_end - plan.visible_from, len(plan.pending_tokens), rows)
            mask = full[len(plan.pending_tokens) + len(plan.forwarded) :]
            plan.forwarded = order
            slots.append(_Slot(plan, len(tokens), len(frontier), mask.to(self._tensors["device"])))
            for node in frontier:
                parent = draft.parents[node]
                tokens.append(draft.tokens[node])
                features.append(plan.root_prediction if parent < 0 else plan.node_predictions[parent])
            positions += [len(state.text) + depth - 1] * len(frontier)
        predicted = self._run(slots, tokens, features, positions)
        frontier_rows = []
        for plan, slot in zip(rounds, slots, strict=True):
            frontier = plan.draft.frontier
            rows = list(predicted[slot.row : slot.row + slot.size])
            plan.node_predictions += [None] * (len(plan.draft.tokens) - len(plan.node_predictions))
            for node, row in zip(frontier, rows, strict=True):
                plan.node_predictions[node] = row
            frontier_rows.append(rows)
        self._grow(rounds, frontier_rows, [plan.draft.levels - depth for plan in rounds])

    def _run(
        self, slots: list[_Slot], tokens: list[int], features: list[torch.Tensor], positions: list[int]
    ) -> torch.Tensor:
        """Packed head forward; the rounds' scratch gains the new K/V. Returns the rows' states [rows, hidden]."""
        device = self._tensors["device"]
        predicted = self.head.forward_rows(
            torch.tensor([tokens], device=device),
            torch.stack(features)[None],
            torch.tensor([positions], device=device),
            _PackedAttention(slots),
        )
        for slot in slots:
            slot.plan.scratch += slot.size
        return predicted[0]

    def _grow(self, rounds: list[_Round], predictions: list[list[torch.Tensor]], levels_left: list[int]) -> None:
        """Children of every round's frontier from its predictions (rows in frontier order), through the head's LM
        head once for all of them: its weights are most of what a draft step reads."""
        logits = self.head.logits(torch.stack([row for rows in predictions for row in rows])).float().cpu()  # [F, K]
        for plan, block, left in zip(
            rounds, logits.split([len(rows) for rows in predictions]), levels_left, strict=True
        ):
            grow_level(plan.draft, block, left, self._draft_vocab)  # q = 0 off the draft vocabulary

    def _commit_true_rows(self, state: _Sequence, plan: _Round) -> None:
        """Keep the K/V of the leading pending rows read from true features (written in place at ``kv_end``)."""
        count = plan.true_pending
        if count <= 0:
            return
        start, end = plan.kv_end, plan.kv_end + count
        if start > state.committed:  # the rows between fell out of the window without being computed
            state.kv_floor = start
        state.committed = end

    def _start(
        self, prompt: list[int], params: SamplingParams, generator: torch.Generator, config: DraftConfig
    ) -> _Sequence:
        if len(prompt) > self.max_seq_len:
            raise InvalidArgumentError(
                "prompt", f"{len(prompt)} tokens exceed the head's context of {self.max_seq_len}"
            )
        empty = [torch.empty(self._kv_heads, 0, self._head_dim, **self._tensors) for _ in self.head.layers]
        lookup = LookupIndex(prompt) if self.lookup_min_match else None
        return _Sequence(
            text=prompt,
            config=config,
            params=params,
            generator=generator,
            keys=list(empty),
            values=list(empty),
            lookup=lookup,
        )

    def _resync(self, state: _Sequence, text: list[int], path: list[int] | None) -> None:
        drafted, state.outstanding = state.outstanding, None
        agree = common_prefix_length(state.text, text)
        # F_p depends on t_0 .. t_p. Rows given since the last resync came for this new text (before its commit),
        # even past where it leaves the old one (a tree's verdict on another leaf than the assumed one); older rows
        # hold only up to ``agree``.
        fresh = agree == len(state.text) or (state.fresh_from is not None and state.fresh_from <= agree)
        state.num_features = min(state.num_features, len(text) if fresh else agree)
        state.features_from = min(state.features_from, state.num_features)
        state.fresh_from = None
        state.committed = min(state.committed, max(agree - 1, 0), state.num_features)
        state.kv_floor = min(state.kv_floor, state.committed)
        state.predicted = {p: g for p, g in state.predicted.items() if state.num_features <= p < agree}
        if path and isinstance(drafted, _Drafted) and drafted.base_length == len(state.text) <= agree:
            # the text follows ``path`` of the proposal: its predictions stand in until true features arrive
            base = drafted.base_length
            if drafted.root_prediction is not None:
                state.predicted.setdefault(base - 1, drafted.root_prediction)
            for depth, node in enumerate(path):
                prediction = drafted.node_predictions[node]
                if prediction is not None and base + depth >= state.num_features:
                    state.predicted[base + depth] = prediction
            state.predicted = {p: g for p, g in state.predicted.items() if p >= state.num_features}
        if state.lookup is not None:
            state.lookup.truncate(agree)
            state.lookup.extend(text[agree:])
        state.text = text
