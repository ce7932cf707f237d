"""Drafters behind one interface: ``model``, ``ngram``, ``early-exit`` and ``eagle``.

Every drafter supports pipelining (``assume_accepted``) and rollback (``sync``); see
:mod:`specdec.drafters.base`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.cache import default_head_dir
from specdec.drafter_kinds import DRAFTER_KINDS, SHAPE_ONLY_KINDS, DrafterKind
from specdec.drafters.base import DraftConfig, Drafter, Proposal, SequenceDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_head import HEAD_CONTEXT
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.errors import InvalidArgumentError, ModelNotFoundError
from specdec.lookup import DEFAULT_LOOKUP_MIN_MATCH
from specdec.models import LoadedModel, ModelShape, check_same_vocabulary, load_model, usable_device
from specdec.precision import check_draft_quantization
from specdec.runner import KVRunner

__all__ = [
    "DEFAULT_LOOKUP_MIN_MATCH",
    "DRAFTER_KINDS",
    "SHAPE_ONLY_KINDS",
    "DraftConfig",
    "Drafter",
    "DrafterKind",
    "EagleDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "Proposal",
    "SequenceDrafter",
    "build_drafter",
    "build_shape_drafter",
    "check_quantizable",
    "default_early_exit_layers",
]


def default_early_exit_layers(target: LoadedModel) -> int:
    """A quarter of the target's layers (at least one): cheap enough to pay for itself."""
    return max(1, target.model.config.num_hidden_layers // 4)


def check_quantizable(kind: str, quantization: str) -> None:
    """InvalidArgumentError naming ``draft_quantization`` unless it is a known one that a ``kind`` drafter can run:
    only an eagle head's layers can be int8 (the other kinds run no weights or the target's own; ``auto`` leaves
    them as they are)."""
    if check_draft_quantization(quantization) == "int8" and kind != "eagle":
        raise InvalidArgumentError("draft_quantization", f"only an eagle drafter's head can be quantized, not {kind!r}")


def build_drafter(
    kind: str,
    target: LoadedModel,
    config: DraftConfig,
    *,
    draft_model: str | LoadedModel | None = None,
    early_exit_layers: int | None = None,
    head_dtype: torch.dtype | None = None,
    eagle_context: int = HEAD_CONTEXT,
    draft_quantization: str = "auto",
    lookup_min_match: int | None = None,
) -> Drafter | None:
    """The drafter of ``kind`` for ``target`` (``None`` for ``kind == "none"``).

    ``eagle`` loads the head in ``draft_model`` (a directory), or with none the head cached for the target
    (:func:`~specdec.cache.default_head_dir`, made by ``specdec distill``), on the target's device in
    ``head_dtype`` (None: the target's dtype), attending over ``eagle_context`` head positions, its draft layers
    ``draft_quantization`` (:class:`~specdec.drafters.eagle.EagleDrafter`; ``auto``: int8 where a float32 head runs
    on a CPU that can); only an eagle head can be int8. An eagle round whose text's tail occurred before, at least
    ``lookup_min_match`` tokens of it (0: never; None: the head's choice, :meth:`EagleDrafter.load`), is a
    prompt-lookup chain instead of the head's draft.
    """
    check_quantizable(kind, draft_quantization)
    if kind in SHAPE_ONLY_KINDS:
        if kind == "eagle" and isinstance(draft_model, LoadedModel):
            raise InvalidArgumentError("draft_model", "the eagle drafter needs a head directory, not a model")
        return build_shape_drafter(
            kind,
            ModelShape.of(target),
            config,
            draft_model=draft_model if isinstance(draft_model, str) else None,
            dtype=head_dtype or target.model.dtype,
            device=target.model.device,
            eagle_context=eagle_context,
            quantization=draft_quantization,
            lookup_min_match=lookup_min_match,
        )
    if kind == "model":
        if draft_model is None:
            raise InvalidArgumentError("draft_model", "the model drafter needs a draft model")
        draft = draft_model if isinstance(draft_model, LoadedModel) else load_model(draft_model)
        check_same_vocabulary(target, draft)
        return ModelDrafter(KVRunner(draft.model), config)
    if kind == "early-exit":
        layers = early_exit_layers or default_early_exit_layers(target)
        total = target.model.config.num_hidden_layers
        if not 1 <= layers < total:
            raise InvalidArgumentError("early_exit_layers", f"must be in [1, {total}), got {layers}")
        return ModelDrafter(KVRunner(target.model, num_layers=layers), config)
    raise InvalidArgumentError("drafter", f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")


def build_shape_drafter(
    kind: str,
    target: ModelShape,
    config: DraftConfig,
    *,
    draft_model: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    eagle_context: int = HEAD_CONTEXT,
    quantization: str = "auto",
    lookup_min_match: int | None = None,
) -> Drafter | None:
    """A drafter of one of :data:`SHAPE_ONLY_KINDS`, which run none of the target's weights, from the target's
    sizes alone (:func:`~specdec.models.load_shape`); ``eagle``: its head in ``dtype`` on ``device``, its draft
    layers ``quantization`` (only an eagle head's can be), its prompt lookup from ``lookup_min_match``."""
    check_quantizable(kind, quantization)
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(config, vocab_size=target.vocab_size)
    if kind != "eagle":
        raise InvalidArgumentError("drafter", f"{kind!r} runs the target's weights; use build_drafter")
    directory = Path(draft_model).expanduser() if draft_model else default_head_dir(target.name)
    if draft_model is None and not directory.is_dir():
        raise ModelNotFoundError(
            f"draft_model: no EAGLE head cached for {target.name!r} in {directory}; "
            f"make one with `specdec distill --target {target.name}` or name one with --draft-model DIR"
        )
    return EagleDrafter.load(
        directory,
        config,
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        dtype=dtype,
        device=usable_device(device),
        context=eagle_context,
        quantization=quantization,
        lookup_min_match=lookup_min_match,
    )
