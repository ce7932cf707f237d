"""KV-cached forward passes over Llama-family decoders, for verifying and drafting token trees.

Our own forward pass over the Hugging Face modules (gpt-fast / vLLM style), no HF cache or generate:

- the tokens of every sequence in one call are packed, ``[T_total, hidden]``, through embeddings,
  norms, projections and MLP; attention runs for many sequences at once: one ``scaled_dot_product_attention``
  per layer, capacity class and power of two of new tokens, over the sequences' slots of a
  :class:`~specdec.kv_pool.KVPool`, their queries padded to the longest and an explicit mask
  (:mod:`specdec.attention_masks`) hiding every key a row may not see (a loop of one call per sequence cost 3x as
  much at 8 sequences);
- each sequence owns one pool slot holding ``length`` committed positions (:class:`~specdec.kv_pool.KVPools`); a
  forward writes its new K/V after them (scratch) and leaves ``length`` alone;
- :meth:`KVRunner.commit` keeps the pending tokens and one tree path: pointer arithmetic for a chain
  prefix, a copy of only the chosen nodes' K/V for a tree path. Rolling back is not committing.
  Moving up a capacity class (doubling) is the only copy of committed KV ever made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from specdec.attention_masks import attention_mask, packed_positions
from specdec.errors import CapacityError, InvalidArgumentError
from specdec.kv_pool import KVPool, KVPools, KVSlot
from specdec.linear import Projection, can_pack
from specdec.tree import ROOT, TokenTree

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})
_NO_TREE = TokenTree.empty()


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's input to :meth:`KVRunner.forward`; the tree's top level hangs off ``pending[-1]``.

    ``pending`` may be empty when the sequence has committed KV and ``tree`` is not empty: the tree then
    hangs off the last committed token, whose logits row the caller already holds (pipelined rounds).
    """

    seq: int
    pending: Sequence[int]
    tree: TokenTree = _NO_TREE


@dataclass
class _SeqState:
    kv: KVSlot | None = None  # None until the first forward
    length: int = 0
    scratch: tuple[int, TokenTree] | None = None  # (pending count, tree) of the last forward


@dataclass(frozen=True)
class _Slot:
    state: _SeqState
    row: int  # first row of this sequence in the packed tokens
    start: int  # committed length = first KV position written
    size: int  # m + N new tokens


@dataclass(frozen=True)
class _Group:
    """How the packed tokens of one forward's sequences in one pool meet it in attention: ``entries`` batch rows of
    one kernel call, each a pool slot (read as a view from ``first``, or gathered by ``gather``) with its queries
    padded to ``longest``."""

    pool: KVPool
    tokens: torch.Tensor | None  # [Tg] this group's packed tokens in packed order; None: all of them
    first: int
    gather: torch.Tensor | None  # pool slots, one per entry; None: entries are slots first, first + 1, ..
    entries: int
    longest: int  # most new tokens of one sequence
    end: int  # keys read per entry: the longest sequence after this forward
    slots: torch.Tensor  # [Tg] pool slot of each of its tokens
    positions: torch.Tensor  # [Tg] KV position each writes
    rows: torch.Tensor | None  # [Tg] row of each in the padded [entries * longest] layout; None: row t
    mask: torch.Tensor | None  # bool [entries, 1, group * longest, end], padding rows see key 0 (no row is empty);
    # None when every row sees every key


class _Layer(NamedTuple):
    """One decoder layer's modules and projections, looked up once."""

    attn: nn.Module
    qkv: Projection  # x -> (query, key, value) rows
    out: Projection
    gate_up: Projection  # x -> (gate, up) rows of the MLP
    down: Projection
    act: Callable[[torch.Tensor], torch.Tensor]
    input_norm: tuple[torch.Tensor, float]  # RMSNorm (weight [hidden], eps)
    post_norm: tuple[torch.Tensor, float]


def _layer(layer: nn.Module, pack: bool) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    return _Layer(
        attn,
        Projection([attn.q_proj, attn.k_proj, attn.v_proj], pack=pack),
        Projection([attn.o_proj], pack=pack),
        Projection([mlp.gate_proj, mlp.up_proj], pack=pack),
        Projection([mlp.down_proj], pack=pack),
        mlp.act_fn,
        _norm(layer.input_layernorm),
        _norm(layer.post_attention_layernorm),
    )


def _norm(module: nn.Module) -> tuple[torch.Tensor, float]:
    return module.weight, module.variance_epsilon


def _rms_norm(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """The HF Llama RMSNorm as one call (bit-identical in float32)."""
    return F.rms_norm(x, norm[0].shape, norm[0], norm[1])


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, heads, head_dim]; ``cos``, ``signed_sin`` [T, 1, head_dim].

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, written as
    ``roll(x) * cat(-sin1, sin2)``: bit-identical and fewer kernels.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def resolve_feature_layers(layers: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """The feature layers :meth:`KVRunner.forward_features` reads: ``layers``, or the final norm's output alone
    (``(num_layers,)``) for None; InvalidArgumentError naming ``feature_layers`` when one is outside ``[0, L]``."""
    resolved = (num_layers,) if layers is None else tuple(int(layer) for layer in layers)
    if any(not 0 <= layer <= num_layers for layer in resolved):
        raise InvalidArgumentError("feature_layers", f"must be in [0, {num_layers}], got {list(resolved)}")
    return resolved


class KVRunner:
    """Per-sequence KV caches and packed forwards over ``model`` (its first ``num_layers`` layers).

    ``pack_weights`` (default: where it pays, float32 on CPU) runs the linear layers as prepacked oneDNN matrix
    multiplies (:mod:`specdec.linear`): a copy of their weights, made here, so later changes to the model's
    weights do not reach the runner.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        num_layers: int | None = None,
        max_seq_len: int | None = None,
        pack_weights: bool | None = None,
    ) -> None:
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise InvalidArgumentError(
                "model",
                f"architecture {config.model_type!r} is not supported (supported: {sorted(SUPPORTED_MODEL_TYPES)})",
            )
        rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise InvalidArgumentError("model", f"rope type {rope_type!r} depends on the sequence length")
        decoder = model.model
        total_layers = len(decoder.layers)
        num_layers = total_layers if num_layers is None else num_layers
        if not 1 <= num_layers <= total_layers:
            raise InvalidArgumentError("num_layers", f"must be in [1, {total_layers}], got {num_layers}")
        limit = config.max_position_embeddings
        if getattr(config, "sliding_window", None):  # full attention is exact inside the window
            limit = min(limit, config.sliding_window)
        max_seq_len = limit if max_seq_len is None else max_seq_len
        if max_seq_len < 1:
            raise InvalidArgumentError("max_seq_len", f"must be >= 1, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        linears = [model.lm_head, *(m for layer in decoder.layers[:num_layers] for m in layer.modules())]
        can = all(can_pack(module) for module in linears if isinstance(module, nn.Linear))
        if pack_weights and not can:
            raise InvalidArgumentError("pack_weights", "needs float32 CPU weights without hooks, and oneDNN")
        self.packed_weights = can if pack_weights is None else pack_weights
        self._embed, self._norm = decoder.embed_tokens, _norm(decoder.norm)
        self._lm_head = Projection([model.lm_head], pack=self.packed_weights)
        self._rotary = decoder.rotary_emb
        self._layers = tuple(_layer(layer, self.packed_weights) for layer in decoder.layers[:num_layers])
        attn = self._layers[0].attn
        self._head_dim, self._scale = attn.head_dim, attn.scaling
        self._qk_norm = hasattr(attn, "q_norm")
        self._vocab_size = int(config.vocab_size)
        self._hidden_size = int(config.hidden_size)
        weight = self._embed.weight
        self._device, self._dtype = weight.device, weight.dtype
        with torch.inference_mode():  # local head counts from the projections' real output widths
            probe = torch.zeros(1, config.hidden_size, device=self._device, dtype=self._dtype)
            self._kv_heads = attn.k_proj(probe).shape[-1] // self._head_dim
            self._group = attn.q_proj(probe).shape[-1] // self._head_dim // self._kv_heads  # query heads per KV head
            self._cos = self._signed_sin = torch.empty(0, self._head_dim, device=self._device, dtype=self._dtype)
        self._kv = KVPools(len(self._layers), self._kv_heads, self._head_dim, device=self._device, dtype=self._dtype)
        self._seqs: dict[int, _SeqState] = {}
        self._next_id = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def hidden_size(self) -> int:
        """Width of one layer's feature row (:meth:`forward_features`)."""
        return self._hidden_size

    @property
    def num_layers(self) -> int:
        """Decoder layers run; as a feature layer (:meth:`forward_features`) it names the final norm's output."""
        return len(self._layers)

    @property
    def num_open(self) -> int:
        return len(self._seqs)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V held for the open sequences (:class:`~specdec.kv_pool.KVPools`: free slots of their capacity
        classes included); 0 when none is open."""
        return self._kv.nbytes

    @torch.inference_mode()
    def open(self) -> int:
        """A new, empty sequence; returns its id."""
        seq, self._next_id = self._next_id, self._next_id + 1
        self._seqs[seq] = _SeqState()
        return seq

    def close(self, seq: int) -> None:
        """Free the sequence's pool slot."""
        kv = self._state(seq).kv
        if kv is not None:
            self._kv.release(kv)
        del self._seqs[seq]

    def length(self, seq: int) -> int:
        """Number of committed positions (KV in place)."""
        return self._state(seq).length

    def forward(self, items: Sequence[ForwardItem], *, all_logits: bool = False) -> list[torch.Tensor]:
        """Run pending tokens and trees of several sequences in one pass; write their K/V as scratch.

        Returns per item float32 logits ``[1 + N, V]``: the row at the last pending token, then one row
        per tree node; with ``all_logits`` ``[m + N, V]`` (a row per pending token too). An item without
        pending tokens gets ``[N, V]``, the node rows only.
        """
        return self._forward(items, all_logits=all_logits, features=())[0]

    def forward_features(
        self, items: Sequence[ForwardItem], layers: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`forward`, plus per item the target's **features** ``[m + N, len(layers) * hidden]`` (float32)
        at every pending token and tree node, one ``hidden``-wide block per entry of ``layers``:

        - ``num_layers`` (the default, alone): the final norm's output, the input of the LM head (EAGLE-1);
        - ``k < num_layers``: the raw output of decoder layer ``k`` (Hugging Face's ``hidden_states[k + 1]``,
          vLLM's auxiliary hidden state ``k + 1``); EAGLE-3 fuses a low, a middle and a high layer. Raw residual
          streams carry massive activations (single values ~22 500 on SmolLM2's layer 14, a third of float16's
          range): they travel in bfloat16, and a head norms each layer's rows before it mixes them.

        An EAGLE drafter (:mod:`specdec.drafters.eagle`) drafts from these; the logits are computed exactly as
        ``forward`` does.
        """
        layers = resolve_feature_layers(layers, self.num_layers)
        if not layers:
            raise InvalidArgumentError("feature_layers", "must name at least one layer")
        return self._forward(items, all_logits=False, features=layers)

    @torch.inference_mode()
    def _forward(
        self, items: Sequence[ForwardItem], *, all_logits: bool, features: tuple[int, ...] = ()
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        slots, tokens, positions = self._plan(items)
        for slot in slots:
            slot.state.scratch = None
        groups = self._groups(slots, items)
        ids, pos = torch.tensor([tokens, positions], device=self._device)
        hidden = self._embed(ids)  # [T, hidden]
        cos, sin = self._cos[pos].unsqueeze(1), self._signed_sin[pos].unsqueeze(1)  # [T, 1, head_dim]
        captured: dict[int, torch.Tensor] = {}  # feature layer -> its rows [T, hidden]
        for index, layer in enumerate(self._layers):
            hidden = hidden + self._attention(index, layer, _rms_norm(hidden, layer.input_norm), cos, sin, groups)
            gate, up = layer.gate_up(_rms_norm(hidden, layer.post_norm))
            hidden = hidden + layer.down(layer.act(gate) * up)[0]
            if index in features:
                captured[index] = hidden.float()
        rows = [
            (slot.row if all_logits or not item.pending else slot.row + len(item.pending) - 1, slot.row + slot.size)
            for slot, item in zip(slots, items, strict=True)
        ]
        selected = hidden[rows[0][0] : rows[0][1]] if len(rows) == 1 else torch.cat([hidden[a:b] for a, b in rows])
        logits = self._lm_head(_rms_norm(selected, self._norm))[0].float()  # [rows, V]
        for slot, item in zip(slots, items, strict=True):
            slot.state.scratch = (len(item.pending), item.tree)
        feature_rows: list[torch.Tensor] = []
        if features:  # RMSNorm is per row: normalising every row leaves the logits' rows unchanged
            if self.num_layers in features:
                captured[self.num_layers] = _rms_norm(hidden, self._norm).float()
            fused = captured[features[0]] if len(features) == 1 else torch.cat([captured[k] for k in features], -1)
            feature_rows = [fused[slot.row : slot.row + slot.size] for slot in slots]
        return list(logits.split([b - a for a, b in rows])), feature_rows

    @torch.inference_mode()
    def commit(self, seq: int, num_pending: int, path: Sequence[int] = ()) -> None:
        """Commit the first ``num_pending`` pending tokens of the last forward, then the tree nodes of ``path``.

        ``path`` is root-to-node order (``TokenTree.path_to``) and needs every pending token committed.
        A chain prefix ``[0, 1, .., k-1]`` moves nothing; other paths copy only their nodes' K/V.
        """
        state = self._state(seq)
        if state.scratch is None:
            raise InvalidArgumentError("seq", f"sequence {seq} has no forward to commit")
        pending, tree = state.scratch
        if not 0 <= num_pending <= pending:
            raise InvalidArgumentError("num_pending", f"must be in [0, {pending}], got {num_pending}")
        path = list(path)
        if path and num_pending != pending:
            raise InvalidArgumentError("path", "a tree path can only follow all pending tokens")
        for depth, node in enumerate(path):
            parent = path[depth - 1] if depth else ROOT
            if not 0 <= node < len(tree) or tree.parents[node] != parent:
                raise InvalidArgumentError("path", f"{path} is not a root-to-node path of the tree")
        moved = next((depth for depth, node in enumerate(path) if node != depth), len(path))
        if moved < len(path):  # nodes only move towards the front, so the copy never reads a written slot
            base = state.length + pending
            source = torch.tensor([base + node for node in path[moved:]], device=self._device)
            target = torch.arange(base + moved, base + len(path), device=self._device)
            for pool in (state.kv.pool.keys, state.kv.pool.values):
                buffer = pool[:, state.kv.index]  # [layers, kv_heads, capacity, head_dim], a view
                buffer.index_copy_(2, target, buffer.index_select(2, source))
        state.length += num_pending + len(path)
        state.scratch = None

    def truncate(self, seq: int, new_length: int) -> None:
        """Drop committed positions after ``new_length`` (pointer arithmetic)."""
        state = self._state(seq)
        if not 0 <= new_length <= state.length:
            raise InvalidArgumentError("new_length", f"must be in [0, {state.length}], got {new_length}")
        state.length, state.scratch = new_length, None

    def _state(self, seq: int) -> _SeqState:
        state = self._seqs.get(seq)
        if state is None:
            raise InvalidArgumentError("seq", f"sequence {seq} is not open")
        return state

    def _plan(self, items: Sequence[ForwardItem]) -> tuple[list[_Slot], list[int], list[int]]:
        """Validate ``items``, reserve buffer space and lay out packed tokens and positions."""
        if not items:
            raise InvalidArgumentError("items", "nothing to forward")
        if len({item.seq for item in items}) != len(items):
            raise InvalidArgumentError("items", "a sequence appears twice in one forward")
        slots: list[_Slot] = []
        tokens: list[int] = []
        positions: list[int] = []
        for item in items:
            state, pending, tree = self._state(item.seq), len(item.pending), item.tree
            if not pending and not (state.length and tree):
                raise InvalidArgumentError(
                    "pending", f"sequence {item.seq}: a pending token is needed, or committed KV and a tree"
                )
            start, size = state.length, pending + len(tree)
            if start + pending + tree.max_depth() > self.max_seq_len:
                raise CapacityError(
                    f"sequence {item.seq}: {start + pending + tree.max_depth()} positions exceed {self.max_seq_len}"
                )
            slots.append(_Slot(state, len(tokens), start, size))
            tokens += item.pending
            tokens += tree.tokens
            positions += packed_positions(start, pending, tree)
        if min(tokens) < 0 or max(tokens) >= self._vocab_size:
            raise InvalidArgumentError("tokens", f"token ids must be in [0, {self._vocab_size})")
        for slot in slots:  # past max_seq_len only for a wide, shallow tree
            needed = slot.start + slot.size
            state = slot.state
            state.kv = self._kv.reserve(state.kv, needed, keep=state.length, limit=max(needed, self.max_seq_len))
        self._extend_rope(max(positions) + 1)
        return slots, tokens, positions

    def _groups(self, slots: list[_Slot], items: Sequence[ForwardItem]) -> list[_Group]:
        """Lay out one forward's attention: a group per pool and power-of-two of new tokens among its sequences (a
        prompt's prefill padding fifteen one-token decodes to its length would attend 15 x its rows), each with its
        entries, padded query rows and mask."""
        groups: dict[tuple[int, int], list[int]] = {}
        for position, slot in enumerate(slots):
            groups.setdefault((id(slot.state.kv.pool), (slot.size - 1).bit_length()), []).append(position)
        whole = len(groups) == 1
        return [
            self._pool_group([slots[i] for i in chosen], [items[i] for i in chosen], whole)
            for chosen in groups.values()
        ]

    def _pool_group(self, slots: list[_Slot], items: list[ForwardItem], whole: bool) -> _Group:
        pool = slots[0].state.kv.pool
        first, gather = pool.batch_view([slot.state.kv.index for slot in slots])
        entries = gather.numel() if gather is not None else max(slot.state.kv.index for slot in slots) - first + 1
        rank = {int(s): e for e, s in enumerate(gather.tolist())} if gather is not None else None
        longest = max(slot.size for slot in slots)
        end = max(slot.start + slot.size for slot in slots)
        mask = torch.zeros(entries, self._group, longest, end, dtype=torch.bool, device=self._device)
        mask[..., 0] = True
        tokens: list[int] = []
        write_slots: list[int] = []
        write_positions: list[int] = []
        rows: list[int] = []
        for slot, item in zip(slots, items, strict=True):
            index = slot.state.kv.index
            entry = rank[index] if rank is not None else index - first
            visible = slot.start + slot.size
            if slot.size == 1:
                mask[entry, :, 0, :visible] = True
            else:
                mask[entry, :, : slot.size, :visible] = attention_mask(
                    slot.start, len(item.pending), item.tree, device=self._device
                )
            tokens += range(slot.row, slot.row + slot.size)
            write_slots += [index] * slot.size
            write_positions += range(slot.start, visible)
            rows += range(entry * longest, entry * longest + slot.size)
        tokens_t, slots_t, positions_t, rows_t = torch.tensor(
            [tokens, write_slots, write_positions, rows], device=self._device
        )
        dense = rows == list(range(entries * longest))  # no padding, entries in packed order: no scatter or gather
        grouped_mask = None if dense and bool(mask.all()) else mask.view(entries, 1, self._group * longest, end)
        return _Group(
            pool,
            None if whole else tokens_t,
            first,
            gather,
            entries,
            longest,
            end,
            slots_t,
            positions_t,
            None if dense else rows_t,
            grouped_mask,
        )

    def _attention(
        self,
        index: int,
        projections: _Layer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        groups: list[_Group],
    ) -> torch.Tensor:
        """Self-attention of layer ``index`` over packed ``x`` [T, hidden]; returns [T, hidden]."""
        count = x.shape[0]
        query, key, value = (rows.reshape(count, -1, self._head_dim) for rows in projections.qkv(x))
        if self._qk_norm:  # Qwen3: RMSNorm over each head
            attn = projections.attn
            query, key = _rms_norm(query, _norm(attn.q_norm)), _rms_norm(key, _norm(attn.k_norm))
        query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
        if groups[0].tokens is None:
            out = self._group_attention(index, groups[0], query, key, value)
        else:
            out = query.new_empty(count, query.shape[1] * self._head_dim)
            for group in groups:
                rows = group.tokens
                out.index_copy_(0, rows, self._group_attention(index, group, query[rows], key[rows], value[rows]))
        return projections.out(out)[0]

    def _group_attention(
        self, index: int, group: _Group, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one group's rows ``query`` [Tg, heads, head_dim] (``key``, ``value``: [Tg, kv_heads,
        head_dim], written to its pool first); returns [Tg, heads * head_dim]."""
        kv_heads, head_dim, heads_per_kv = self._kv_heads, self._head_dim, self._group
        pool_keys, pool_values = group.pool.keys[index], group.pool.values[index]  # [slots, kv, capacity, dim]
        pool_keys[group.slots, :, group.positions] = key
        pool_values[group.slots, :, group.positions] = value
        if group.gather is None:
            span = slice(group.first, group.first + group.entries)
            keys, values = pool_keys[span, :, : group.end], pool_values[span, :, : group.end]
        else:
            keys = pool_keys[:, :, : group.end].index_select(0, group.gather)
            values = pool_values[:, :, : group.end].index_select(0, group.gather)
        entries, longest = group.entries, group.longest
        padded = query
        if group.rows is not None:
            padded = query.new_zeros(entries * longest, *query.shape[1:]).index_copy_(0, group.rows, query)
        # the query heads sharing a KV head become extra query rows: [entries, kv_heads, group * longest, head_dim]
        grouped = padded.view(entries, longest, kv_heads, heads_per_kv, head_dim).permute(0, 2, 3, 1, 4)
        out = F.scaled_dot_product_attention(  # 4-D inputs take the fused kernels
            grouped.reshape(entries, kv_heads, heads_per_kv * longest, head_dim),
            keys,
            values,
            attn_mask=group.mask,
            scale=self._scale,
        )
        out = out.view(entries, kv_heads, heads_per_kv, longest, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(entries * longest, -1)  # [entries * longest, heads * head_dim]
        return out if group.rows is None else out.index_select(0, group.rows)

    def _extend_rope(self, size: int) -> None:
        """Grow the rotary tables [positions, head_dim] to cover ``size`` positions (doubling)."""
        if size <= self._cos.shape[0]:
            return
        size = min(self.max_seq_len, max(size, 2 * self._cos.shape[0], 256))
        positions = torch.arange(size, device=self._device)[None]
        cos, sin = self._rotary(self._cos, positions)  # [1, size, head_dim], computed as HF does
        half = self._head_dim // 2
        self._cos, self._signed_sin = cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)
