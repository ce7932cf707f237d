"""An EAGLE draft head (Li et al. 2024, arXiv 2401.15077; EAGLE-3's truncated draft vocabulary, 2503.01840).

The head continues the target from the target's own **features** ``F`` (the final norm's output, the input of
the LM head, :meth:`~specdec.runner.KVRunner.forward_features`). Head position ``i`` reads the feature of the
position before and the token at ``i``::

    x_i  = fusion_fc([embed(t_i), F_(i-1)])        [2H] -> [H]
    h_i  = decoder layers(x_i)                      causal over head positions 1..i, RoPE at position i
    g_i  = norm(h_i)                                 the head's prediction of F_i (the target's final norm)
    q_i  = softmax(lm_head(g_i))                     over the K draft tokens: the law of t_(i+1)

Drafting past the committed text feeds ``g`` back as the next input feature.

**Fused features (EAGLE-3, arXiv 2503.01840).** A head made with ``feature_layers`` reads, instead of ``F``, the
outputs of a low, a middle and a high target layer (:func:`eagle3_layers`, each RMS-normalised by the target's
runner), projected by ``fc`` [layers * H -> H] before the fusion: ``x_i = fusion_fc([embed(t_i), fc(A_(i-1))])``.
Lower layers still hold what the last one has already traded for its next-token guess. Drafted rows feed ``g``
back as before, and ``g`` is still trained towards ``F`` (it feeds the LM head). The LM head holds the target's
rows of the ``K`` draft tokens (``draft_to_target``); every other token has ``q = 0``, so verification stays
exact. ``embed_tokens`` and ``lm_head`` are the target's, frozen; ``fusion_fc``, the layers and ``norm`` train.

Checkpoints use the vLLM ``speculators`` layout: ``config.json`` (``speculators_model_type``,
``transformer_layer_config``, ``draft_vocab_size``, the verifier's name) and ``model.safetensors`` with
``embed_tokens.weight``, ``fusion_fc.weight``, ``layers.N.*``, ``norm.weight``, ``lm_head.weight`` and the
vocabulary maps ``d2t`` (draft id -> target id offset) and ``t2d`` (target ids in the draft vocabulary).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
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
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"

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


class EagleHead(nn.Module):
    """The head's modules and its forward over packed rows; attention is the caller's (:data:`Attend`)."""

    def __init__(
        self,
        layer_config: LlamaConfig,
        draft_to_target: torch.Tensor,
        vocab_size: int,
        feature_layers: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        hidden = layer_config.hidden_size
        if draft_to_target.ndim != 1 or not 1 <= len(draft_to_target) <= vocab_size:
            raise InvalidArgumentError("draft_vocab", f"must hold 1..{vocab_size} token ids")
        self.layer_config = layer_config
        self.vocab_size = vocab_size
        self.feature_layers = tuple(feature_layers)  # target layers fused (EAGLE-3); empty: the final norm's output
        if self.feature_layers:
            self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(vocab_size, hidden)
        self.fusion_fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(layer_config, i) for i in range(layer_config.num_hidden_layers))
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
        """The head's input features [..., H] of target rows [..., feature_width]: ``fc`` of fused rows, or the
        final-norm rows themselves."""
        return self.fc(rows.to(self.fc.weight.dtype)) if self.feature_layers else rows

    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        draft_to_target: torch.Tensor,
        num_layers: int = 1,
        feature_layers: tuple[int, ...] = (),
    ) -> EagleHead:
        """A fresh head for ``target``: its embeddings, final norm and LM-head rows; layers initialised from the
        target's last ``num_layers`` layers (a far better start than random for a one-layer head). With
        ``feature_layers`` (e.g. :func:`eagle3_layers`) the head fuses those layers' rows; ``fc`` starts as the
        final norm's weight over the highest one, the nearest of them to the final-norm rows."""
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
        with torch.no_grad():
            head.embed_tokens.weight.copy_(decoder.embed_tokens.weight)
            head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target])
            head.norm.weight.copy_(decoder.norm.weight)
            for own, source in zip(head.layers, decoder.layers[-num_layers:], strict=True):
                own.load_state_dict(source.state_dict())
            hidden = config.hidden_size  # start as "embedding + feature": the identity on each half, halved
            eye = torch.eye(hidden) * 0.5
            head.fusion_fc.weight.copy_(torch.cat([eye, eye], dim=1))
            if feature_layers:
                highest = max(range(len(feature_layers)), key=lambda block: feature_layers[block])
                head.fc.weight.zero_()
                head.fc.weight[:, highest * hidden : (highest + 1) * hidden] = torch.diag(decoder.norm.weight)
        head.embed_tokens.weight.requires_grad_(False)
        head.lm_head.weight.requires_grad_(False)
        return head

    def forward_rows(
        self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """Predicted features ``g`` [B, T, H] for ``tokens`` [B, T], input ``features`` [B, T, H] (the feature of
        each row's previous position) and RoPE ``positions`` [B, T]; ``attend`` supplies keys, values and mask."""
        x = self.fusion_fc(torch.cat([self.embed_tokens(tokens), features.to(self.fusion_fc.weight.dtype)], dim=-1))
        cos, sin = self.rotary(x, positions)  # [B, T, head_dim]
        for index, layer in enumerate(self.layers):
            x = x + self._attention(index, layer.self_attn, layer.input_layernorm(x), cos, sin, attend)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., K] of predicted features [..., H]."""
        return self.lm_head(predicted)

    def _attention(
        self, index: int, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        head_dim = attn.head_dim

        def heads(projection: nn.Module) -> torch.Tensor:  # [B, T, H'] -> [B, heads, T, head_dim]
            return projection(x).view(batch, length, -1, head_dim).transpose(1, 2)

        query, key, value = heads(attn.q_proj), heads(attn.k_proj), heads(attn.v_proj)
        cos, sin = cos[:, None], sin[:, None]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin
        out = attend(index, query, key, value)  # [B, heads, T, head_dim]
        return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


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
    fused = bool(head.feature_layers)
    model_type = FUSED_MODEL_TYPE if fused else SPECULATORS_MODEL_TYPE
    config = {
        "architectures": ["Eagle3Speculator" if fused else "EagleSpeculator"],
        "speculators_model_type": model_type,
        "speculators_version": "0.1.0",
        "draft_vocab_size": head.draft_vocab_size,
        "target_vocab_size": head.vocab_size,
        "target_hidden_size": head.hidden_size,
        "layernorms": True,
        "fusion_bias": False,
        "feature": "rms_normalised_layer_outputs" if fused else "final_norm_output",
        "eagle_aux_hidden_state_layer_ids": list(head.feature_layers) if fused else None,
        "transformer_layer_config": head.layer_config.to_dict(),
        "speculators_config": {
            "algorithm": model_type,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": info.num_draft_tokens}],
            "verifier": {"name_or_path": info.verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }
    partial = directory / (WEIGHTS_FILE + ".partial")
    save_file(tensors, str(partial))
    partial.rename(directory / WEIGHTS_FILE)  # never a half-written head under the real name
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_head(
    directory: Path, *, hidden_size: int | None = None, vocab_size: int | None = None
) -> tuple[EagleHead, HeadInfo]:
    """The head stored in ``directory``, in eval mode without gradients; checked against the target's
    ``hidden_size`` and ``vocab_size`` when given. Every problem is one line naming the field or file."""
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise ModelNotFoundError(f"draft_model: {directory} holds no EAGLE head ({CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
        model_type = config["speculators_model_type"]
        layer_config = LlamaConfig(**config["transformer_layer_config"])
        draft_vocab, target_vocab = int(config["draft_vocab_size"]), int(config["target_vocab_size"])
        verifier = config["speculators_config"]["verifier"]["name_or_path"]
        methods = config["speculators_config"].get("proposal_methods") or [{}]
        num_draft_tokens = int(methods[0].get("speculative_tokens", 4))
        feature_layers = tuple(int(k) for k in config.get("eagle_aux_hidden_state_layer_ids") or ())
    except (ValueError, KeyError, TypeError) as error:
        raise InvalidArgumentError("draft_model", f"{config_path}: not a speculators config ({error!r})") from error
    expected = FUSED_MODEL_TYPE if feature_layers else SPECULATORS_MODEL_TYPE
    if model_type != expected:
        raise InvalidArgumentError(
            "draft_model", f"{config_path}: speculators_model_type {model_type!r} is not {expected!r}"
        )
    if hidden_size is not None and layer_config.hidden_size != hidden_size:
        raise IncompatibleDraftError(
            f"draft_model: head hidden size {layer_config.hidden_size} != the target's {hidden_size}"
        )
    if vocab_size is not None and target_vocab != vocab_size:
        raise IncompatibleDraftError(f"draft_model: head vocabulary {target_vocab} != the target's {vocab_size}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as error:
        raise InvalidArgumentError("draft_model", f"{weights_path}: corrupt or truncated ({error})") from error
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)
    if d2t is None or len(d2t) != draft_vocab:
        raise InvalidArgumentError("draft_model", f"{weights_path}: d2t must hold draft_vocab_size={draft_vocab} rows")
    head = EagleHead(layer_config, d2t.long() + torch.arange(draft_vocab), target_vocab, feature_layers)
    tensors["draft_to_target"] = head.draft_to_target
    try:
        head.load_state_dict(tensors, strict=True)
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:300]
        raise InvalidArgumentError(
            "draft_model", f"{weights_path}: weights do not match the config ({reason})"
        ) from error
    head.eval().requires_grad_(False)
    return head, HeadInfo(verifier, num_draft_tokens)
