"""What a target forward costs by the positions in it, measured once when a verifier starts.

Adaptive speculation prices every draft length by the verifier's forward cost at the positions it would bring
(:class:`~specdec.adaptive.CostCurve`), learnt from the forwards it has seen. A fresh router has seen none, and
the first it sees are the sizes it happens to choose: after a spell of plain steps (1-5 positions on a CPU, all
costing about the same) the curve extrapolated that flat line and priced 25 positions as 5, so ``auto`` drafted
more than paid into forwards up to twice as long: on the CPU stack its first 5-stream phase ran 17-19 % below
speculation off, 4-9 % with the ladder below (``bench/results/sweep-auto-default-tree/``). So a verifier times a
ladder of forward sizes before it serves and reports them in its ``Status``; a router starts its curve from them, and
every measured forward updates it as before.
"""

from __future__ import annotations

import time

import torch

from specdec.runner import ForwardItem
from specdec.tree import TokenTree
from specdec.verification import Runner

CALIBRATION_CONTEXT = 32  # committed tokens of the timed sequence: a short request's
CALIBRATION_REPEATS = 2  # timed forwards per size (the fastest counts: a pause only ever slows one)


def calibration_sizes(max_positions: int) -> list[int]:
    """The forward sizes timed: powers of two up to ``max_positions`` (none when it is below 1)."""
    sizes, size = [], 1
    while size <= max_positions:
        sizes.append(size)
        size *= 2
    return sizes


def measure_forward_costs(runner: Runner, max_positions: int, *, seed: int = 0) -> list[tuple[int, float]]:
    """``(positions, seconds)`` of one forward at each of :func:`calibration_sizes`: one sequence with a short
    committed text, a pending token and a chain of ``positions - 1`` draft tokens (nothing of it committed), the
    fastest of ``CALIBRATION_REPEATS`` after one untimed forward of that size. The sequence is closed after."""
    sizes = calibration_sizes(min(max_positions, runner.max_seq_len - CALIBRATION_CONTEXT))
    if not sizes:
        return []
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(runner.vocab_size, (CALIBRATION_CONTEXT + sizes[-1],), generator=generator).tolist()
    context, draft = tokens[:CALIBRATION_CONTEXT], tokens[CALIBRATION_CONTEXT:]
    seq = runner.open()
    try:
        runner.forward([ForwardItem(seq, context)])
        runner.commit(seq, len(context))
        costs = []
        for size in sizes:
            item = [ForwardItem(seq, draft[:1], TokenTree.chain(draft[1:size]))]
            _finished(runner.forward(item))  # untimed: a size's first forward may set up kernels and buffers
            best = float("inf")
            for _ in range(CALIBRATION_REPEATS):
                started = time.perf_counter()
                _finished(runner.forward(item))
                best = min(best, time.perf_counter() - started)
            costs.append((size, best))
        return costs
    finally:
        runner.close(seq)


def _finished(logits: list[torch.Tensor]) -> None:
    """Wait for a forward's work to end (on a GPU it is queued, not done, when ``forward`` returns)."""
    logits[0][-1, 0].item()
