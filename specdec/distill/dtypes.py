"""What ``specdec distill`` computes in: the dtype the target writes training data in and whether the head trains
under bfloat16 autocast, each ``auto`` by default, chosen from a measurement of this machine
(:func:`bfloat16_speedup`) at the rows each multiplies: a decode step's batch, a training batch's share.

Neither needs float32's exact arithmetic: training data needs the target's answers and feature rows, and a head
trained under bfloat16 autocast is as good (README). What decides is speed, and that depends on the hardware: a
2-core Xeon with AMX runs a matrix multiply ~4x faster in bfloat16, a GPU more, but a Xeon with AVX512-BF16 and no
AMX runs it at 0.57x, and there bfloat16 autocast made training steps 1.6x *slower* than float32 (the demo's head
saw 186 k tokens in 2.5 minutes against 304 k: ``bench/results/distill-train-dtype.md``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdec.models import synchronize
from specdec.precision import check_distill_dtype

Speedup = Callable[[PreTrainedModel], float]

# "auto" generates in bfloat16 where the target's matrix multiplies run this much faster in it: the answers then
# differ from float32's (a near-tie goes elsewhere), which only a clear gain is worth.
GENERATION_BFLOAT16_PAYS = 1.5
# "auto" trains under bfloat16 autocast where they run this much faster: step time followed the matrix multiplies
# (0.6x of them, 0.6-0.8x of the steps on that Xeon); the margin covers autocast's casts and the measurement's noise.
TRAINING_BFLOAT16_PAYS = 1.2
# Training multiplies thousands of rows at once; measured at 96, a GPU would time kernel launches, not arithmetic,
# and see no gain. 512 rows take ~1 s to measure on a 2-core CPU (0.62 on that Xeon, against 0.68 at 96 rows).
TRAINING_ROWS = 512
GENERATION_ROWS = 96  # a decode step of a full generation batch (specdec distill's --batch-size)


def bfloat16_speedup(model: PreTrainedModel, rows: int = GENERATION_ROWS, repeats: int = 7) -> float:
    """float32 time over bfloat16 time of a matrix multiply the size of ``model``'s MLP projections over ``rows``
    rows (a decode step of a full generation batch), on the model's device: about 4 on a 2-core Xeon with AMX, 0.57
    on one without (SmolLM2, 96 rows). Each dtype is warmed up, then the two are timed in turn ``repeats`` times
    and each keeps its best, so a stall of the machine (page reclaim while a large model loads) slows one repeat,
    not one dtype. Timed as two blocks it once returned 76 on that Xeon, and a ``specdec distill`` run there chose
    float32 (its cause not pinned down; a stall in the bfloat16 block would do it)."""
    device = next(model.parameters()).device
    hidden, width = int(model.config.hidden_size), int(model.config.intermediate_size)
    operands = {
        dtype: (
            torch.randn(rows, hidden, device=device, dtype=dtype),
            torch.randn(width, hidden, device=device, dtype=dtype),
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    best = dict.fromkeys(operands, math.inf)
    for repeat in range(repeats + 1):  # the first round warms up (kernel choice, thread pools), untimed
        for dtype, (rows_in, weight) in operands.items():
            synchronize(device)
            start = time.perf_counter()
            for _ in range(10):
                F.linear(rows_in, weight)
            synchronize(device)
            if repeat:
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.float32] / best[torch.bfloat16]


def generation_dtype(choice: str, model: PreTrainedModel, speedup: Speedup | None = None) -> torch.dtype:
    """The dtype the target generates training data in: ``choice`` (``"float32"``, ``"bfloat16"``), or for
    ``"auto"`` bfloat16 where ``speedup(model)`` (default :func:`bfloat16_speedup`) is at least
    :data:`GENERATION_BFLOAT16_PAYS` (CPUs with AMX, GPUs), float32 elsewhere."""
    return _chosen(choice, "data_dtype", model, speedup, GENERATION_BFLOAT16_PAYS)


def training_dtype(choice: str, model: PreTrainedModel, speedup: Speedup | None = None) -> torch.dtype:
    """The dtype the head trains in (bfloat16: under autocast): ``choice``, or for ``"auto"`` bfloat16 where
    ``speedup(model)`` (default :func:`bfloat16_speedup` over :data:`TRAINING_ROWS` rows) is at least
    :data:`TRAINING_BFLOAT16_PAYS`, float32 elsewhere (without hardware for it, bfloat16 arithmetic is emulated and
    slower)."""
    return _chosen(
        choice, "train_dtype", model, speedup or (lambda m: bfloat16_speedup(m, TRAINING_ROWS)), TRAINING_BFLOAT16_PAYS
    )


def _chosen(choice: str, field: str, model: PreTrainedModel, speedup: Speedup | None, pays: float) -> torch.dtype:
    if check_distill_dtype(choice, field) != "auto":
        return getattr(torch, choice)
    return torch.bfloat16 if (speedup or bfloat16_speedup)(model) >= pays else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: the name ``--data-dtype`` and ``--train-dtype`` take and reports print."""
    return str(dtype).removeprefix("torch.")


def model_in_dtype(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """What generates training data in ``dtype`` (:func:`generation_dtype`): ``model`` itself when it is in ``dtype``,
    else a copy of it in ``dtype`` (the model as loaded stays as it is: the head and the held-out data read it)."""
    return model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
