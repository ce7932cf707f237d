"""Loading target and draft models: a short alias, a ``.gguf`` file, a local directory or a hub id.

No network code of our own: hub ids go through ``transformers``, first from the local cache only and
then (unless ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` is set) from the hub. A GGUF model loads from its
float32 copy in the cache (:func:`~specdec.cache.gguf_copy_dir`), made by its first load. Every failure to find
or load a model becomes :class:`~specdec.errors.ModelNotFoundError` naming what was tried.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from safetensors.torch import save_model
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as transformers_logging

from specdec.cache import gguf_copy_dir
from specdec.errors import IncompatibleDraftError, InvalidArgumentError, ModelNotFoundError
from specdec.model_files import MODEL_ALIASES, local_location, tokenizer_at

_TRUE_VALUES = frozenset({"1", "on", "yes", "true"})
T = TypeVar("T")
LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM in eval mode without gradients, plus what the engine needs to know about it.

    ``tokenizer`` is None for models built in memory (tests) or directories shipped without one.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class ModelShape:
    """What a drafter that runs none of a target's weights (ngram, an EAGLE head) needs to know of it."""

    name: str
    vocab_size: int
    hidden_size: int

    @classmethod
    def of(cls, loaded: LoadedModel) -> ModelShape:
        return cls(loaded.name, loaded.vocab_size, int(loaded.model.config.hidden_size))


def quiet_model_loading() -> None:
    """Keep transformers' per-tensor progress bars and warnings off a command's output."""
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()


def load_model(name: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load ``name`` (alias, ``.gguf`` path, local directory or hub id) in ``dtype`` on ``device``.

    Raises ModelNotFoundError with the list of what was tried when nothing loads, and InvalidArgumentError naming
    ``device`` for a device this machine does not have (before any weights are read).
    """
    device = usable_device(device)
    location = local_location(name)
    if location is None:
        return _from_hub(
            name,
            lambda local_only: _finish(
                AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=local_only),
                AutoTokenizer.from_pretrained(name, local_files_only=local_only),
                name,
                device,
            ),
        )
    directory, kwargs = location
    if "gguf_file" in kwargs:
        directory, kwargs = _gguf_copy(name, directory, kwargs["gguf_file"])
    model = _local_model(name, directory, kwargs, dtype)
    return _finish(model, _local_tokenizer(directory, kwargs), name, device)


def usable_device(device: str | torch.device) -> torch.device:
    """``device`` parsed; InvalidArgumentError naming ``device`` when it is no device name or a CUDA device this
    machine lacks (torch would fail later, mid-load, with a traceback)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidArgumentError("device", f"{device!r} is not a torch device ({error})") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidArgumentError("device", f"{device!r}: this machine has no CUDA device")
        if parsed.index is not None and parsed.index >= count:
            raise InvalidArgumentError("device", f"{device!r}: this machine has {count} CUDA device(s)")
    return parsed


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA runs asynchronously; a CPU queues none): what a timing does
    before it reads the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _local_model(name: str, directory: Path, kwargs: dict[str, str], dtype: torch.dtype) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise ModelNotFoundError(f"model {name!r}: cannot load {directory} ({kwargs}): {reason}") from error


def _gguf_copy(name: str, directory: Path, gguf_file: str) -> tuple[Path, dict[str, str]]:
    """The location of the float32 copy of a GGUF model, made in the cache on its first load; the file's own where
    the cache cannot be written.

    Why: ``transformers`` parses the GGUF file in Python once each for the config, the weights and the tokenizer,
    ~25 s for the 135M target on this CPU, and every service start and test process paid it; the safetensors copy
    loads in under a second. Its tensors are the dequantised ones bit for bit, so outputs do not change. Written
    under a temporary name and renamed whole, so processes starting together never see half a copy.
    """
    copy_dir = gguf_copy_dir(directory / gguf_file)
    gguf = directory, {"gguf_file": gguf_file}
    partial = copy_dir.with_name(f"{copy_dir.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True, exist_ok=True)
        try:
            model = _local_model(name, directory, gguf[1], torch.float32)
            _save_copy(model, _local_tokenizer(*gguf), partial)
            os.rename(partial, copy_dir)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    except OSError as error:
        if not copy_dir.is_dir():  # else another process renamed its copy there first
            LOG.warning("cannot cache a float32 copy of %s (%s); loading the GGUF file each time", gguf_file, error)
            return gguf
    return copy_dir, {}


def _save_copy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, directory: Path) -> None:
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)  # the copy's weights are plain float32
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})  # tied weights stored once
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def load_shape(name: str) -> ModelShape:
    """The :class:`ModelShape` of ``name`` from its config alone: no weights are read into memory (a drafter
    machine serving an n-gram or EAGLE drafter for a 70B target needs its sizes, not its 140 GB)."""
    location = local_location(name)
    if location is None:
        config = _from_hub(name, lambda local_only: AutoConfig.from_pretrained(name, local_files_only=local_only))
    else:
        directory, kwargs = location
        try:
            config = AutoConfig.from_pretrained(directory, **kwargs)
        except (OSError, ValueError) as error:
            reason = " ".join(str(error).split())
            raise ModelNotFoundError(f"model {name!r}: cannot read the config in {directory}: {reason}") from error
    return ModelShape(name, int(config.vocab_size), int(config.hidden_size))


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise IncompatibleDraftError unless ``draft`` proposes token ids with the same meaning as ``target``.

    Compares the logit widths and, when both have a tokenizer, the whole token -> id mapping.
    """
    if target.vocab_size != draft.vocab_size:
        raise IncompatibleDraftError(
            f"draft {draft.name!r} has vocabulary size {draft.vocab_size}, "
            f"target {target.name!r} has {target.vocab_size}; they must be equal"
        )
    if target.tokenizer is None or draft.tokenizer is None:
        return
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda pair: pair[1])[:5]
        raise IncompatibleDraftError(
            f"draft {draft.name!r} and target {target.name!r} map tokens to ids differently "
            f"(e.g. {differing}); a draft must share the target's tokenizer"
        )


def _from_hub(name: str, load: Callable[[bool], T]) -> T:
    """``load(local_files_only)`` of a hub id: the local Hugging Face cache first, then the hub unless offline
    mode is set."""
    tried = [f"not an alias ({', '.join(MODEL_ALIASES)})", "not an existing .gguf file or directory"]
    offline = any(os.environ.get(var, "").lower() in _TRUE_VALUES for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    for local_only in (True,) if offline else (True, False):
        try:
            return load(local_only)
        except (OSError, ValueError) as error:
            where = "local Hugging Face cache" if local_only else "Hugging Face hub"
            tried.append(f"{where}: {' '.join(str(error).split())}")  # one line: HF's messages span several
    if offline:
        tried.append("hub not tried because HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set")
    raise ModelNotFoundError(f"model {name!r} not found: " + "; ".join(tried))


def _local_tokenizer(directory: Path, kwargs: dict[str, str]) -> PreTrainedTokenizerBase | None:
    """The tokenizer stored next to the weights, or None when the directory ships none."""
    try:
        return tokenizer_at(directory, kwargs)
    except (OSError, ValueError):
        return None


def _finish(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, name: str, device: str | torch.device
) -> LoadedModel:
    model = model.to(device).eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, name, int(model.config.vocab_size), eos_token_ids(model, tokenizer))


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> frozenset[int]:
    """Every id that ends generation: generation config, model config and tokenizer together."""
    found: set[int] = set()
    sources = [getattr(model, "generation_config", None), model.config, tokenizer]
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is None:
            continue
        found.update([value] if isinstance(value, int) else value)
    return frozenset(int(token) for token in found)
