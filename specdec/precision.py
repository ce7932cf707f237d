"""The precisions a model loads in, and what a draft head's layers may be quantized to, by name: one list for every
command and worker that loads a model (torch-free, so the services' configuration can check a name without importing
torch)."""

from __future__ import annotations

from specdec.errors import InvalidArgumentError

MODEL_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


def check_dtype(dtype: str) -> str:
    """``dtype`` when it names one of :data:`MODEL_DTYPES`; InvalidArgumentError naming ``dtype`` otherwise."""
    if dtype not in MODEL_DTYPES:
        raise InvalidArgumentError("dtype", f"must be one of {', '.join(MODEL_DTYPES)}, got {dtype!r}")
    return dtype


# What an EAGLE head's draft layers run on (:class:`~specdec.drafters.eagle.EagleDrafter`): ``auto`` int8 weights where
# the head is float32 on a CPU that runs them, as loaded elsewhere; ``none`` as loaded; ``int8`` int8 or refused.
DRAFT_QUANTIZATIONS: tuple[str, ...] = ("auto", "none", "int8")


def check_draft_quantization(quantization: str) -> str:
    """``quantization`` when it names one of :data:`DRAFT_QUANTIZATIONS`; InvalidArgumentError naming
    ``draft_quantization`` otherwise."""
    if quantization not in DRAFT_QUANTIZATIONS:
        raise InvalidArgumentError(
            "draft_quantization", f"must be one of {', '.join(DRAFT_QUANTIZATIONS)}, got {quantization!r}"
        )
    return quantization


# What ``specdec distill`` computes in (:mod:`specdec.distill.dtypes`): the dtype its target writes training data in
# (``--data-dtype``) and the one its head trains in (``--train-dtype``): ``auto`` bfloat16 where this machine runs it
# measurably faster than float32, float32 elsewhere; or the one named.
DISTILL_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")


def check_distill_dtype(dtype: str, field: str) -> str:
    """``dtype`` when it names one of :data:`DISTILL_DTYPES`; InvalidArgumentError naming ``field`` otherwise."""
    if dtype not in DISTILL_DTYPES:
        raise InvalidArgumentError(field, f"must be one of {', '.join(DISTILL_DTYPES)}, got {dtype!r}")
    return dtype
