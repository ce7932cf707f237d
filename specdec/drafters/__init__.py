"""Drafters behind one interface: ``model``, ``ngram`` and ``early-exit``.

Every drafter supports pipelining (``assume_accepted``) and rollback (``sync``); see
:mod:`specdec.drafters.base`.
"""

from __future__ import annotations

from typing import Literal

from specdec.drafters.base import DraftConfig, Drafter, Proposal, SequenceDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.errors import InvalidArgumentError
from specdec.models import LoadedModel, check_same_vocabulary, load_model
from specdec.runner import KVRunner

DrafterKind = Literal["none", "ngram", "model", "early-exit"]
DRAFTER_KINDS: tuple[str, ...] = ("none", "ngram", "model", "early-exit")

__all__ = [
    "DRAFTER_KINDS",
    "DraftConfig",
    "Drafter",
    "DrafterKind",
    "ModelDrafter",
    "NgramDrafter",
    "Proposal",
    "SequenceDrafter",
    "build_drafter",
    "default_early_exit_layers",
]


def default_early_exit_layers(target: LoadedModel) -> int:
    """A quarter of the target's layers (at least one): cheap enough to pay for itself."""
    return max(1, target.model.config.num_hidden_layers // 4)


def build_drafter(
    kind: str,
    target: LoadedModel,
    config: DraftConfig,
    *,
    draft_model: str | LoadedModel | None = None,
    early_exit_layers: int | None = None,
) -> Drafter | None:
    """The drafter of ``kind`` for ``target`` (``None`` for ``kind == "none"``)."""
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(config, vocab_size=target.vocab_size)
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
