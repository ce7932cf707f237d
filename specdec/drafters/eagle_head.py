"""An EAGLE draft head (Li et al. 2024, arXiv 2401.15077; EAGLE-3's truncated draft vocabulary, 2503.01840).

The head continues the target from the target's own **features** ``F`` (the final norm's output, the input of
the LM head, :meth:`~specdec.runner.KVRunner.forward_features`). Head position ``i`` reads the feature of the
position before and the token at ``i``::

    x_i  = fusion_fc([embed(t_i), F_(i-1)])        [2H] -> [H]
    h_i  = decoder layers(x_i)                      causal over head positions 1..i, RoPE at position i
    g_i  = norm(h_i)                                 the head's prediction of F_i (the target's final norm)
    q_i  = softmax(lm_head(g_i))                     over the K draft tokens: the law of t_(i+1)

Drafting past the committed text feeds ``g`` back as the next input feature.

**Fused features (EAGLE-3, arXiv 2503.01840).** A head made with ``feature_layers`` is EAGLE-3's head exactly as
vLLM and ``speculators`` build it. It reads the raw outputs ``A`` of a low, a middle and a high target layer
(:func:`eagle3_layers`) instead of ``F``: lower layers still hold what the last one has already traded for its
next-token guess. Per-layer RMS norms (``fc_norm``, EAGLE 3.1; raw residual streams carry massive activations)
and ``fc`` [layers * H -> H] make ``x``; the first decoder layer attends over both halves side by side::

    x_i  = fc([fc_norm_k(A_k,(i-1)) for each layer k])
    h_i  = decoder layers, the first over [input_layernorm(embed(t_i)), hidden_norm(x_i)]    [2H]
    q_i  = softmax(lm_head(norm(h_i)))

and a drafted row feeds back the pre-norm ``h`` as its successor's ``x``. :class:`Eagle3Options` holds the
variants ``speculators`` knows (``fc_norm``, ``norm_before_fc``, ``norm_before_residual``, ``norm_output``), so
heads trained elsewhere load too. Both kinds hold the target's LM-head rows of the ``K`` draft tokens
(``draft_to_target``); every other token has ``q = 0``, so verification stays exact. ``embed_tokens`` and
``lm_head`` are the target's, frozen; everything else trains.

Checkpoints use the vLLM ``speculators`` layout: ``config.json`` (``speculators_model_type``,
``transformer_layer_config``, ``draft_vocab_size``, the verifier's name) and ``model.safetensors`` with
``embed_tokens.weight``, ``fusion_fc.weight`` (EAGLE-1) or ``fc.weight`` and ``fc_norm.N.weight`` (EAGLE-3),
``layers.N.*``, ``norm.weight``, ``lm_head.weight`` and the vocabulary maps ``d2t`` (draft id -> target id
offset) and ``t2d`` (target ids in the draft vocabulary). An EAGLE-3 checkpoint is what vLLM's
``Eagle3LlamaForCausalLM`` loads (``--speculative-config '{"model": DIR}'``; ``tests/test_eagle3_layout.py``
recomputes vLLM's forward from the file by weight name); its ``eagle_aux_hidden_state_layer_ids`` count the
embedding output as 0, so they are one more than :func:`eagle3_layers`. Beyond that layout, ``config.json`` may hold
``specdec_lookup_min_match``: the prompt-lookup tail ``specdec distill`` measured pays with this head
(:mod:`specdec.distill.lookup_choice`), which an eagle drafter uses unless told otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from specdec.errors import IncompatibleDraftError, InvalidArgumentError, ModelNotFoundError

SPECULATORS_MODEL_TYPE, FUSED_MODEL_TYPE = "eagle", "eagle3"
# Head positions a head attends over: what ``specdec distill`` trains on (a response and most of its prompt) and what
# drafting keeps of the committed text, so a long prompt costs the head no more than this to draft from.
HEAD_CONTEXT = 640
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
LOOKUP_KEY = "specdec_lookup_min_match"  # config.json: the lookup tail distill chose (specdec.distill.lookup_choice)

# attend(layer index, query [B, heads, T, d], key [B, kv_heads, T, d], value) -> [B, heads, T, d]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The low, middle and high decoder layers whose outputs an EAGLE-3 head fuses: EAGLE-3's hidden states
    ``2, L // 2, L - 3`` (index 0 there is the embedding output, so layer ``k`` here is its ``k + 1``);
    ``(1, 14, 26)`` for SmolLM2's 30 layers. Clamped into ``0 .. L - 1`` for the tiny test models."""
    return tuple(min(max(k, 0), num_layers - 1) for k in (1, num_layers // 2 - 1, num_layers - 4))


@dataclass(frozen=True)
class HeadInfo:
    """What a checkpoint says beyond the weights: the target it was trained for and how."""

    verifier: str
    num_draft_tokens: int
    lookup_min_match: int | None = None  # the prompt-lookup tail distill chose (0: never; None: not measured)


@dataclass(frozen=True)
class Eagle3Options:
    """The EAGLE-3 variants ``speculators`` and vLLM know, by their config names; the defaults are what
    ``specdec distill`` trains (a missing field in a checkpoint means vLLM's default, see :func:`load_head`)."""

    fc_norm: bool = True  # an RMSNorm per target layer before fc: raw rows differ in scale by 10-100x
    norm_before_fc: bool = False  # one RMSNorm over the concatenated rows before fc
    norm_before_residual: bool = True  # the first layer's residual is hidden_norm(x), not x
    norm_output: bool = False  # a drafted row feeds back the post-norm output, not the pre-norm one


class EagleHead(nn.Module):
    """The head's modules and its forward over packed rows; attention is the caller's (:data:`Attend`).

    :meth:`forward_rows` returns the **state** a row hands on: what a drafted successor reads as its input
    feature (EAGLE-1: the predicted ``F``; EAGLE-3: the pre-norm ``h``); :meth:`output` is the row the LM head reads.
    """

    def __init__(
        self,
        layer_config: LlamaConfig,
        draft_to_target: torch.Tensor,
        vocab_size: int,
        feature_layers: tuple[int, ...] = (),
        options: Eagle3Options | None = None,
    ) -> None:
        super().__init__()
        hidden = layer_config.hidden_size
        if draft_to_target.ndim != 1 or not 1 <= len(draft_to_target) <= vocab_size:
            raise InvalidArgumentError("draft_vocab", f"must hold 1..{vocab_size} token ids")
        self.layer_config = layer_config
        self.vocab_size = vocab_size
        self.feature_layers = tuple(feature_layers)  # target layers fused (EAGLE-3); empty: the final norm's output
        self.options = (options or Eagle3Options()) if self.feature_layers else None
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(layer_config, i) for i in range(layer_config.num_hidden_layers))
        if self.options is None:
            self.fusion_fc = nn.Linear(2 * hidden, hidden, bias=False)
        else:
            width = len(self.feature_layers) * hidden
            if self.options.norm_before_fc:
                self.input_norm = LlamaRMSNorm(width, eps=layer_config.rms_norm_eps)
            if self.options.fc_norm:
                self.fc_norm = nn.ModuleList(
                    LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps) for _ in self.feature_layers
                )
            self.fc = nn.Linear(width, hidden, bias=False)
            first = self.layers[0]
            first.hidden_norm = LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps)
            bias = bool(getattr(layer_config, "attention_bias", False))
            for name in ("q_proj", "k_proj", "v_proj"):  # the first layer reads [embedding, feature]: 2H wide
                projection = getattr(first.self_attn, name)
                setattr(first.self_attn, name, nn.Linear(2 * hidden, projection.out_features, bias=bias))
        self.norm = LlamaRMSNorm(hidden, eps=layer_config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(draft_to_target), bias=False)
        self.rotary = LlamaRotaryEmbedding(layer_config)
        self.register_buffer("draft_to_target", draft_to_target.long().clone())

    @property
    def hidden_size(self) -> int:
        return self.layer_config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return len(self.draft_to_target)

    @property
    def feature_width(self) -> int:
        """Width of the target rows the head reads: ``hidden_size`` per fused layer, or one final-norm row."""
        return self.hidden_size * max(1, len(self.feature_layers))

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """The head's input features [..., H] of target rows [..., feature_width]: EAGLE-3's normed ``fc`` of
        the fused rows, or the final-norm rows themselves."""
        rows = rows.to(self.embed_tokens.weight.dtype)
        if self.options is None:
            return rows
        if self.options.norm_before_fc:
            rows = self.input_norm(rows)
        if self.options.fc_norm:
            blocks = rows.chunk(len(self.feature_layers), dim=-1)
            rows = torch.cat([norm(block) for norm, block in zip(self.fc_norm, blocks, strict=True)], dim=-1)
        return self.fc(rows)

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        draft_to_target: torch.Tensor,
        num_layers: int = 1,
        feature_layers: tuple[int, ...] = (),
    ) -> EagleHead:
        """A fresh head for ``target``: its embeddings, final norm and LM-head rows; layers initialised from the
        target's last ``num_layers`` layers (a far better start than random for a one-layer head), with their
        input starting as "embedding + feature", halved. With ``feature_layers`` (e.g. :func:`eagle3_layers`) the
        head fuses those layers' rows; ``fc`` starts as the final norm's weight over the highest one, the
        nearest of them to the final-norm rows."""
        if num_layers < 1:
            raise InvalidArgumentError("layers", f"must be >= 1, got {num_layers}")
        total = int(target.config.num_hidden_layers)
        if any(not 0 <= layer < total for layer in feature_layers):
            raise InvalidArgumentError("feature_layers", f"must be in [0, {total}), got {list(feature_layers)}")
        config = LlamaConfig(**target.config.to_dict())
        config.num_hidden_layers = num_layers
        for stale in ("quantization_config", "_name_or_path", "architectures"):
            config.__dict__.pop(stale, None)
        head = cls(config, draft_to_target, int(target.config.vocab_size), tuple(feature_layers))
        decoder = target.model
        hidden = config.hidden_size
        with torch.no_grad():
            head.embed_tokens.weight.copy_(decoder.embed_tokens.weight)
            head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target])
            head.norm.weight.copy_(decoder.norm.weight)
            for index, (own, source) in enumerate(zip(head.layers, decoder.layers[-num_layers:], strict=True)):
                weights = source.state_dict()
                if index == 0 and feature_layers:  # q/k/v read [embedding, feature]: each half gets the weight, halved
                    for name in ("q_proj", "k_proj", "v_proj"):
                        weight = weights[f"self_attn.{name}.weight"]
                        weights[f"self_attn.{name}.weight"] = torch.cat([weight, weight], dim=-1) * 0.5
                    weights["hidden_norm.weight"] = weights["input_layernorm.weight"]
                own.load_state_dict(weights)
            if feature_layers:
                highest = max(range(len(feature_layers)), key=lambda block: feature_layers[block])
                head.fc.weight.zero_()
                head.fc.weight[:, highest * hidden : (highest + 1) * hidden] = torch.diag(decoder.norm.weight)
            else:
                eye = torch.eye(hidden) * 0.5
                head.fusion_fc.weight.copy_(torch.cat([eye, eye], dim=1))
        head.embed_tokens.weight.requires_grad_(False)
        head.lm_head.weight.requires_grad_(False)
        return head

    def forward_rows(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        query_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each row's state [B, T, H] (see the class) for ``tokens`` [B, T], input ``features`` [B, T, H] (the
        feature or state of each row's previous position) and RoPE ``positions`` [B, T]; ``attend`` supplies
        keys, values and mask.

        ``query_index`` [B, Q] (indices into T): the states of those rows only, [B, Q, H]; every row still gives the
        last layer its keys and values, but only those rows run its queries, output projection and MLP. Training
        uses it: the rows of a long prompt are only context to the response rows the loss reads."""
        embeds = self.embed_tokens(tokens)
        features = features.to(embeds.dtype)
        if self.options is None:
            residual = self.fusion_fc(torch.cat([embeds, features], dim=-1))
            first_input = None
        else:
            first = self.layers[0]
            normed = first.hidden_norm(features)
            residual = normed if self.options.norm_before_residual else features
            first_input = torch.cat([first.input_layernorm(embeds), normed], dim=-1)
        cos, sin = self.rotary(residual, positions)  # [B, T, head_dim]
        for index, layer in enumerate(self.layers):
            x = first_input if index == 0 and first_input is not None else layer.input_layernorm(residual)
            queried = query_index if index == len(self.layers) - 1 else None
            if queried is not None:
                residual = gather_rows(residual, queried)
            residual = residual + self._attention(index, layer.self_attn, x, cos, sin, attend, queried)
            residual = residual + layer.mlp(layer.post_attention_layernorm(residual))
        if self.options is None or self.options.norm_output:
            return self.norm(residual)
        return residual

    def output(self, states: torch.Tensor) -> torch.Tensor:
        """The rows [..., H] the LM head reads, of states [..., H]: the head's prediction of the target's ``F``."""
        return states if self.options is None or self.options.norm_output else self.norm(states)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., K] of states [..., H]."""
        return self.lm_head(self.output(states))

    def _attention(
        self,
        index: int,
        attn: nn.Module,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        query_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        head_dim = attn.head_dim

        def heads(projection: nn.Module, rows: torch.Tensor) -> torch.Tensor:  # [B, T, width] -> [B, heads, T, d]
            return projection(rows).view(*rows.shape[:2], -1, head_dim).transpose(1, 2)

        def rotated(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return states * cos[:, None] + _rotate_half(states) * sin[:, None]

        key, value = rotated(heads(attn.k_proj, x), cos, sin), heads(attn.v_proj, x)
        if query_index is not None:
            x, cos, sin = (gather_rows(rows, query_index) for rows in (x, cos, sin))
        query = rotated(heads(attn.q_proj, x), cos, sin)
        out = attend(index, query, key, value)  # [B, heads, Q, head_dim]
        return attn.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


def gather_rows(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` [B, Q] of ``states`` [B, T, W]: [B, Q, W]."""
    return states.gather(1, index[..., None].expand(-1, -1, states.shape[-1]))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def scaled_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Grouped-query attention of ``query`` [B, heads, Tq, d] over ``key``/``value`` [B, kv_heads, Tk, d]
    with a boolean ``mask`` [Tq, Tk] or [B, 1, Tq, Tk] (True: visible)."""
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)


def save_head(head: EagleHead, directory: Path, info: HeadInfo) -> None:
    """Write ``head`` to ``directory`` in the speculators layout (weights in float32)."""
    directory.mkdir(parents=True, exist_ok=True)
    ids = head.draft_to_target
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors = {name: tensor.detach().float().contiguous() for name, tensor in head.state_dict().items()}
    tensors.pop("draft_to_target")
    tensors["d2t"] = (ids - torch.arange(len(ids))).contiguous()
    tensors["t2d"] = t2d
    partial = directory / (WEIGHTS_FILE + ".partial")
    save_file(tensors, str(partial))
    partial.rename(directory / WEIGHTS_FILE)  # never a half-written head under the real name
    save_head_config(head, directory, info)


def save_head_config(head: EagleHead, directory: Path, info: HeadInfo) -> None:
    """Write the ``config.json`` of ``head`` (what :func:`save_head` writes beside the weights): alone, it records
    a changed ``info`` of a saved head without writing its weights again."""
    options = head.options
    model_type = SPECULATORS_MODEL_TYPE if options is None else FUSED_MODEL_TYPE
    config = {
        "architectures": ["EagleSpeculator" if options is None else "Eagle3Speculator"],
        "speculators_model_type": model_type,
        "speculators_version": "0.1.0",
        "draft_vocab_size": head.draft_vocab_size,
        "target_vocab_size": head.vocab_size,
        "target_hidden_size": head.hidden_size,
        "transformer_layer_config": head.layer_config.to_dict(),
        "speculators_config": {
            "algorithm": model_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": info.num_draft_tokens}],
            "verifier": {"name_or_path": info.verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }
    if info.lookup_min_match is not None:
        config[LOOKUP_KEY] = info.lookup_min_match
    if options is None:
        config.update(layernorms=True, fusion_bias=False)
    else:
        config.update(asdict(options))
        config["eagle_aux_hidden_state_layer_ids"] = [layer + 1 for layer in head.feature_layers]  # vLLM's count
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_head(
    directory: Path, *, hidden_size: int | None = None, vocab_size: int | None = None
) -> tuple[EagleHead, HeadInfo]:
    """The head stored in ``directory``, in eval mode without gradients; checked against the target's
    ``hidden_size`` and ``vocab_size`` when given. Every problem is one line naming the field or file.

    EAGLE-3 checkpoints of ``speculators``, vLLM and SpecForge load too: a missing option means vLLM's default,
    and SpecForge's ``midlayer.`` is the first layer."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelNotFoundError(f"draft_model: {directory} holds no EAGLE head ({CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
        model_type = config["speculators_model_type"]
        layer_config = LlamaConfig(**config["transformer_layer_config"])
        draft_vocab = int(config["draft_vocab_size"])
        target_vocab = int(config.get("target_vocab_size") or layer_config.vocab_size)
        verifier = config["speculators_config"]["verifier"]["name_or_path"]
        methods = config["speculators_config"].get("proposal_methods") or [{}]
        num_draft_tokens = int(methods[0].get("speculative_tokens", 4))
        lookup_min_match = None if config.get(LOOKUP_KEY) is None else int(config[LOOKUP_KEY])
        aux_layers = config.get("eagle_aux_hidden_state_layer_ids") if model_type == FUSED_MODEL_TYPE else None
        feature_layers = tuple(int(k) - 1 for k in aux_layers or ())
        names = [option.name for option in fields(Eagle3Options)]  # absent: vLLM's default
        options = Eagle3Options(**{name: bool(config.get(name, name == "norm_before_residual")) for name in names})
    except (ValueError, KeyError, TypeError) as error:
        raise InvalidArgumentError("draft_model", f"{config_path}: not a speculators config ({error!r})") from error
    if model_type not in (SPECULATORS_MODEL_TYPE, FUSED_MODEL_TYPE):
        raise InvalidArgumentError("draft_model", f"{config_path}: speculators_model_type {model_type!r} is not served")
    if lookup_min_match is not None and lookup_min_match < 0:
        raise InvalidArgumentError("draft_model", f"{config_path}: {LOOKUP_KEY} must be >= 0, got {lookup_min_match}")
    if config.get("feature") == "rms_normalised_layer_outputs":
        raise InvalidArgumentError(
            "draft_model",
            f"{directory} holds a fused head older than specdec's EAGLE-3 layout: train it again (specdec distill)",
        )
    if model_type == FUSED_MODEL_TYPE and (not feature_layers or min(feature_layers) < 0):
        raise InvalidArgumentError(
            "draft_model", f"{config_path}: eagle_aux_hidden_state_layer_ids must list target layers (1 or more)"
        )
    if hidden_size is not None and layer_config.hidden_size != hidden_size:
        raise IncompatibleDraftError(
            f"draft_model: head hidden size {layer_config.hidden_size} != the target's {hidden_size}"
        )
    if vocab_size is not None and target_vocab != vocab_size:
        raise IncompatibleDraftError(f"draft_model: head vocabulary {target_vocab} != the target's {vocab_size}")
    try:
        tensors = {name.replace("midlayer.", "layers.0."): t for name, t in load_file(str(weights_path)).items()}
    except (SafetensorError, OSError) as error:
        raise InvalidArgumentError("draft_model", f"{weights_path}: corrupt or truncated ({error})") from error
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    if d2t is None or len(d2t) != draft_vocab:
        raise InvalidArgumentError("draft_model", f"{weights_path}: d2t must hold draft_vocab_size={draft_vocab} rows")
    head = EagleHead(layer_config, d2t.long() + torch.arange(draft_vocab), target_vocab, feature_layers, options)
    tensors["draft_to_target"] = head.draft_to_target
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:300]
        raise InvalidArgumentError(
            "draft_model", f"{weights_path}: weights do not match the config ({reason})"
        ) from error
    head.eval().requires_grad_(False)
    return head, HeadInfo(verifier, num_draft_tokens, lookup_min_match)
