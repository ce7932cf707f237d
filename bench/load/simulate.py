"""A router driven by simulated workers: real gRPC, real router, no model (load tests of the router and the wire).

The drafters and verifiers are :mod:`bench.load.simulated` processes. They speak the real
``specdec.v1.Drafter`` / ``specdec.v1.Verifier`` protocol (and ``grpc.health.v1``), but a verdict accepts draft
position ``i`` with a configured probability ``acceptance[i]`` and every call costs a sleep drawn from a
configured latency distribution, so one 2-core machine can hold hundreds of concurrent streams and the router's
own overhead (its loop, handler threads, detokenization, the wire) is what is measured. The router is the real
``python -m router`` process with the real tokenizer, so text prompts and streaming text work unchanged;
``num_routers`` of them share the workers as ``specdec up --num-routers`` places them (a client spreads its requests
over ``SimulatedStack.grpc_addresses``).

>>> config = SimulationConfig(acceptance=(0.8, 0.6))                              # doctest: +SKIP
>>> with simulated_stack(config, log_dir=Path("/tmp/sim")) as stack:              # doctest: +SKIP
...     async with AsyncClient(stack.grpc_addresses[0]) as client: ...

Latency strings (milliseconds): ``const:5``, ``normal:5,1`` (mean, sigma; clipped at 0), ``lognormal:5,0.3``
(mean 5 ms, sigma 0.3 of the underlying normal), ``uniform:3,7`` (low, high).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, cast

import numpy as np

from bench.services import ROOT, Services
from grpc_common.arrivals import DEFAULT_FRACTION
from specdec import eventloop, gc_policy

WORKER_MODULE = "bench.load.simulated"
LatencyKind = Literal["const", "normal", "lognormal", "uniform"]
_PARAMETERS: dict[str, int] = {"const": 1, "normal": 2, "lognormal": 2, "uniform": 2}
T = TypeVar("T")


@dataclass(frozen=True)
class LatencySpec:
    """A latency distribution in milliseconds; ``str()`` gives back the string it was parsed from.

    ``normal`` draws are clipped at 0 (a latency is never negative). ``lognormal:m,s`` has mean ``m`` ms and
    log-space sigma ``s``: ``exp(N(ln m - s²/2, s²))``, so the mean stays the number written whatever the spread.
    """

    kind: LatencyKind
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _PARAMETERS:
            raise ValueError(f"latency kind must be one of {', '.join(_PARAMETERS)}, got {self.kind!r}")
        if not (math.isfinite(self.a) and math.isfinite(self.b)) or self.a < 0 or self.b < 0:
            raise ValueError(f"latency parameters must be finite and >= 0, got {self}")
        if self.kind == "uniform" and self.b < self.a:
            raise ValueError(f"uniform:low,high needs low <= high, got {self}")
        if self.kind == "lognormal" and self.a == 0:
            raise ValueError("lognormal needs a mean > 0")

    @classmethod
    def parse(cls, text: str) -> LatencySpec:
        """``"lognormal:5,0.3"`` → ``LatencySpec("lognormal", 5.0, 0.3)``; raises ValueError naming the problem."""
        kind, _, rest = text.strip().partition(":")
        if kind not in _PARAMETERS:
            raise ValueError(f"latency {text!r}: kind must be one of {', '.join(_PARAMETERS)}")
        try:
            values = [float(part) for part in rest.split(",")] if rest else []
        except ValueError:
            raise ValueError(f"latency {text!r}: parameters must be numbers (milliseconds)") from None
        if len(values) != _PARAMETERS[kind]:
            raise ValueError(f"latency {text!r}: {kind} takes {_PARAMETERS[kind]} parameter(s), got {len(values)}")
        return cls(cast(LatencyKind, kind), *values)

    def __str__(self) -> str:
        return f"{self.kind}:{self.a:g}" if self.kind == "const" else f"{self.kind}:{self.a:g},{self.b:g}"

    @property
    def mean_ms(self) -> float:
        """The distribution's mean (for ``normal``, before clipping at 0)."""
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def sample_ms(self, rng: np.random.Generator) -> float:
        """One draw, in milliseconds (>= 0)."""
        if self.kind == "const":
            return self.a
        if self.kind == "normal":
            return max(0.0, float(rng.normal(self.a, self.b)))
        if self.kind == "lognormal":
            return float(rng.lognormal(math.log(self.a) - self.b**2 / 2, self.b))
        return float(rng.uniform(self.a, self.b))


def parse_acceptance(text: str) -> tuple[float, ...]:
    """``"0.8,0.7"`` → ``(0.8, 0.7)``: acceptance probability per draft position, each in [0, 1]."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"acceptance {text!r}: comma-separated probabilities expected") from None
    if any(not 0.0 <= value <= 1.0 for value in values):
        raise ValueError(f"acceptance {text!r}: every probability must be in [0, 1]")
    return values


def drafter_kind(draft_support: int) -> str:
    """The kind a simulated drafter reports: one that sends ``q`` acts as a model drafter, one that does not as an
    n-gram drafter (whose ``q`` is one-hot)."""
    return "model" if draft_support else "ngram"


def expected_accepted_length(acceptance: Sequence[float], num_draft_tokens: int) -> float:
    """``1 + Σ_{i<γ} Π_{j<=i} a_j``: mean tokens per round of full-length chains (the last ``a`` repeats)."""
    total, survive = 1.0, 1.0
    for position in range(num_draft_tokens):
        survive *= acceptance[min(position, len(acceptance) - 1)]
        total += survive
    return total


@dataclass(frozen=True)
class SimulationConfig:
    """Everything a simulated stack is built from; defaults model a large target verified in ~20 ms batches.

    Draft and verify latencies are per batched call (one sleep per batch, as a GPU forward costs about the same for
    a batch as for one sequence); each sequence in a verify batch adds ``verify_per_seq_ms``. ``draft_support`` is
    the size of the sparse ``q`` row the drafters send (0: no distribution, one-hot ``q`` as an n-gram drafter
    sends); it decides the drafter kind the workers report. ``event_loop`` (None: inherited) is the
    ``SPECDEC_EVENT_LOOP`` of every process of the stack (:mod:`specdec.eventloop`). ``arrival_wait`` is every
    worker's wait for the calls it expects back, as a fraction of a batch (:mod:`grpc_common.arrivals`; 0: none).
    ``worker_streams`` False: the routers send every batch as a unary RPC instead of on a stream (:mod:`router.calls`).
    ``gc_policy`` (None: inherited) is the routers' ``SPECDEC_GC`` (:mod:`specdec.gc_policy`). ``router_source``
    (None: this checkout) is the checkout the routers run from: a worktree of another commit compares two routers.
    """

    acceptance: tuple[float, ...] = (0.8, 0.7, 0.6, 0.5)
    draft_latency: LatencySpec = field(default_factory=lambda: LatencySpec("lognormal", 4.0, 0.3))
    verify_latency: LatencySpec = field(default_factory=lambda: LatencySpec("lognormal", 20.0, 0.2))
    verify_per_seq_ms: float = 0.05
    num_drafters: int = 1
    num_verifiers: int = 1
    num_routers: int = 1
    vocab_size: int = 49152
    seed: int = 0
    max_concurrent_requests: int = 1024
    max_waiting_requests: int = 4096
    tokenizer: str = "smollm2-135m"
    model: str = "smollm2-135m"
    num_draft_tokens: int = 4
    draft_support: int = 4
    event_loop: str | None = None
    arrival_wait: float = DEFAULT_FRACTION
    worker_streams: bool = True
    gc_policy: str | None = None
    router_source: str | None = None

    def __post_init__(self) -> None:
        if not self.acceptance or any(not 0.0 <= value <= 1.0 for value in self.acceptance):
            raise ValueError(f"acceptance must be probabilities in [0, 1], got {self.acceptance}")
        if self.num_verifiers < 1 or self.num_drafters < 0 or self.num_routers < 1:
            raise ValueError(
                f"needs >= 1 verifier, >= 0 drafters and >= 1 router, got {self.num_verifiers}, {self.num_drafters},"
                f" {self.num_routers}"
            )
        if self.verify_per_seq_ms < 0 or self.draft_support < 0:
            raise ValueError("verify_per_seq_ms and draft_support must be >= 0")

    @property
    def drafter_kind(self) -> str:
        """What the simulated drafters report in Status (and the router's default drafter kind)."""
        return drafter_kind(self.draft_support)

    @property
    def expected_accepted_length(self) -> float:
        """Mean accepted length of full-length chains, for comparison with the measured one."""
        return expected_accepted_length(self.acceptance, self.num_draft_tokens)


def _argparse_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """``parse`` with its ValueError message shown by argparse as is."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def add_simulation_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--sim-*`` options; defaults are :class:`SimulationConfig`'s."""
    defaults = SimulationConfig()
    group = parser.add_argument_group("simulated workers")
    group.add_argument(
        "--sim-acceptance",
        type=_argparse_type(parse_acceptance),
        default=defaults.acceptance,
        help="acceptance probability per draft position, comma-separated; the last repeats (default %(default)s)",
    )
    latency_help = "latency per batched call in ms: const:M, normal:M,S, lognormal:M,S or uniform:LO,HI"
    group.add_argument(
        "--sim-draft-latency",
        type=_argparse_type(LatencySpec.parse),
        default=defaults.draft_latency,
        help=f"drafter {latency_help} (default %(default)s)",
    )
    group.add_argument(
        "--sim-verify-latency",
        type=_argparse_type(LatencySpec.parse),
        default=defaults.verify_latency,
        help=f"verifier base {latency_help} (default %(default)s)",
    )
    group.add_argument(
        "--sim-verify-per-seq-ms",
        type=float,
        default=defaults.verify_per_seq_ms,
        help="verifier cost per sequence in a batch, ms (default %(default)s)",
    )
    group.add_argument("--sim-drafters", type=int, default=defaults.num_drafters, help="(default %(default)s)")
    group.add_argument("--sim-verifiers", type=int, default=defaults.num_verifiers, help="(default %(default)s)")
    group.add_argument(
        "--sim-routers",
        type=int,
        default=defaults.num_routers,
        help="router processes sharing the workers; requests go to them in turn (default %(default)s)",
    )
    group.add_argument("--sim-seed", type=int, default=defaults.seed, help="seed of the workers' latency draws")
    group.add_argument(
        "--sim-max-concurrent",
        type=int,
        default=defaults.max_concurrent_requests,
        help="the router's --max-concurrent-requests (default %(default)s)",
    )
    group.add_argument(
        "--sim-max-waiting",
        type=int,
        default=defaults.max_waiting_requests,
        help="the router's --max-waiting-requests (default %(default)s)",
    )


def simulation_config_from_args(args: argparse.Namespace) -> SimulationConfig:
    """The config of the ``--sim-*`` options (raises ValueError on inconsistent values)."""
    return SimulationConfig(
        acceptance=tuple(args.sim_acceptance),
        draft_latency=args.sim_draft_latency,
        verify_latency=args.sim_verify_latency,
        verify_per_seq_ms=args.sim_verify_per_seq_ms,
        num_drafters=args.sim_drafters,
        num_verifiers=args.sim_verifiers,
        num_routers=args.sim_routers,
        seed=args.sim_seed,
        max_concurrent_requests=args.sim_max_concurrent,
        max_waiting_requests=args.sim_max_waiting,
    )


@dataclass(frozen=True)
class SimulatedStack:
    """A running simulated stack: the routers' addresses (one per router, in order), the model name they serve,
    and its processes."""

    grpc_addresses: tuple[str, ...]
    http_addresses: tuple[str, ...]
    model: str
    services: Services

    @property
    def grpc_address(self) -> str:
        """The first router's (the only one unless ``num_routers`` > 1)."""
        return self.grpc_addresses[0]

    @property
    def http_address(self) -> str:
        return self.http_addresses[0]


def worker_args(config: SimulationConfig, role: Literal["drafter", "verifier"], index: int) -> list[str]:
    """Command-line arguments of one simulated worker; worker ``index`` of a role gets seed ``config.seed + index``."""
    args = [
        "--role",
        role,
        "--port",
        "0",
        "--seed",
        str(config.seed + index),
        "--acceptance",
        ",".join(f"{value:g}" for value in config.acceptance),
        "--vocab-size",
        str(config.vocab_size),
        "--model",
        config.model,
        "--arrival-wait",
        f"{config.arrival_wait:g}",
    ]
    if role == "verifier":
        return [*args, "--latency", str(config.verify_latency), "--per-sequence-ms", str(config.verify_per_seq_ms)]
    return [*args, "--latency", str(config.draft_latency), "--draft-support", str(config.draft_support)]


@contextlib.contextmanager
def simulated_stack(config: SimulationConfig, *, log_dir: Path) -> Iterator[SimulatedStack]:
    """Start the simulated workers and ``num_routers`` real routers (subprocesses, logs in ``log_dir``); stop all on
    exit.

    Workers start together; the routers start (together) once they serve, so their first health check finds them all.
    """
    env = {} if config.event_loop is None else {eventloop.ENV: config.event_loop}
    router_env = env if config.gc_policy is None else {**env, gc_policy.ENV: config.gc_policy}
    with Services(log_dir) as services:
        spawned = [
            services.spawn(f"sim-verifier-{index}", WORKER_MODULE, worker_args(config, "verifier", index), env)
            for index in range(config.num_verifiers)
        ] + [
            services.spawn(f"sim-drafter-{index}", WORKER_MODULE, worker_args(config, "drafter", index), env)
            for index in range(config.num_drafters)
        ]
        addresses = [service.wait_ready(60.0)["address"] for service in spawned]
        router_args = [
            "--model",
            config.model,
            "--tokenizer",
            config.tokenizer,
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--num-draft-tokens",
            str(config.num_draft_tokens),
            "--tree-width",  # chains: what expected_accepted_length models
            "1",
            "--max-concurrent-requests",
            str(config.max_concurrent_requests),
            "--max-waiting-requests",
            str(config.max_waiting_requests),
        ]
        for address in addresses[: config.num_verifiers]:
            router_args += ["--verifier", address]
        for address in addresses[config.num_verifiers :]:
            router_args += ["--drafter", address]
        if config.num_drafters:
            router_args += ["--default-drafter", config.drafter_kind]
        if not config.worker_streams:
            router_args.append("--no-worker-streams")
        names = ["router"] if config.num_routers == 1 else [f"router-{index}" for index in range(config.num_routers)]
        source = Path(config.router_source) if config.router_source else ROOT
        routers = [services.spawn(name, "router", router_args, router_env, source) for name in names]
        ready = [router.wait_ready(120.0) for router in routers]
        yield SimulatedStack(tuple(r["grpc"] for r in ready), tuple(r["http"] for r in ready), config.model, services)
