"""The garbage collector of a serving process: what startup built is frozen out of it (and in the router, passes are
rarer).

CPython runs a young-generation pass every 700 net container allocations, and every tenth of those also walks the
middle generation. A router round allocates dozens of short-lived containers (futures, tasks, messages, records),
so at a few thousand rounds a second the collector ran several hundred times a second, and its older passes walked
the objects startup made (the tokenizer, the modules of transformers, grpc and aiohttp), none of which ever becomes
garbage. A full pass walks all of them and stops the process meanwhile: about 30 ms in a router, 190 ms in a verifier
holding SmolLM2-135M (``python -m bench.gc_pause``, ``bench/results/gc-pause.md``). :func:`settle`, called once a
process serves, collects once, moves every surviving object into the permanent generation (``gc.freeze``) and
in the router makes passes rarer (:data:`SERVER_THRESHOLDS`): cyclic garbage is still found, a little later. On the
simulated stack that took 4-18 % off the router's CPU per round at 1, 64 and 500 streams and nothing measurable at
32 (``python -m bench.overhead --gc server,default``, ``bench/results/router-gc.md``, ``router-gc-32.md``). The
verifier and the drafter keep CPython's thresholds: their loops allocate far less, so rarer passes saved them no
time, while each pass, walking up to 10 000 young objects, became a pause of ~10 ms between forwards instead of
1-4 ms (the real CPU stack under 8 streams for a minute, ``bench/results/gc-pause.md``).

``SPECDEC_GC`` chooses, read when :func:`settle` runs, so a bench can start the same process both ways:

- ``server`` (or unset): as above;
- ``default``: CPython's own collector, untouched.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping

from specdec.errors import InvalidArgumentError

ENV = "SPECDEC_GC"
CHOICES = ("server", "default")
# A young pass every 10 000 net allocations instead of 700, a middle one every 10 of those, an old one every 10
# middle ones (and then only once the old generation has grown by a quarter, as CPython always requires). Measured
# against 50 000 and against freezing alone: 50 000 cost more CPU per round at 64 streams than CPython's default.
SERVER_THRESHOLDS = (10_000, 10, 10)


def choice_from(environ: Mapping[str, str] | None = None) -> str:
    """``$SPECDEC_GC`` (default ``server``); InvalidArgumentError naming the variable for anything else."""
    environ = os.environ if environ is None else environ
    choice = environ.get(ENV, "").strip().lower() or "server"
    if choice not in CHOICES:
        raise InvalidArgumentError(ENV, f"must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice


def settle(choice: str | None = None, *, thresholds: tuple[int, int, int] | None = SERVER_THRESHOLDS) -> str:
    """Apply ``choice`` (None: :func:`choice_from` the environment) to this process's collector; returns it.
    ``thresholds``: the passes' new thresholds under ``server`` (None: CPython's, kept; the workers' choice).

    Call it once the process has built what it serves with and before it serves: what exists then is never collected.
    """
    choice = choice_from() if choice is None else choice_from({ENV: choice})
    if choice == "server":
        gc.collect()
        gc.freeze()
        if thresholds is not None:
            gc.set_threshold(*thresholds)
    return choice
