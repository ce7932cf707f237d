"""The real serving stack (verifier, drafters, router) as loopback subprocesses, for the load scripts.

``model_stack(StackOptions(...))`` starts ``python -m verifier_service``, one ``python -m drafter_service`` per
drafter kind and ``python -m router`` (no Ray: the same services ``specdec up`` places as actors, but with
process ids the soak can watch) and yields their addresses; everything stops on exit. The load scripts
(:mod:`bench.soak`, :mod:`bench.compare`) drive it through ``specdec bench``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.services import Service, Services


@dataclass(frozen=True)
class StackOptions:
    """What to start. Threads are torch intra-op threads per service (this machine has 2 cores).

    ``device`` and ``dtype`` are the verifier's and the model drafters' (``cuda`` puts both on the GPU).
    """

    target: str = "smollm2-135m"
    device: str = "cpu"
    dtype: str = "float32"
    drafter_kinds: tuple[str, ...] = ("ngram",)
    early_exit_layers: int | None = None
    num_draft_tokens: int = 4
    verifier_threads: int = 1
    drafter_threads: int = 1
    max_concurrent_requests: int = 64
    max_batch_tokens: int | None = None  # the verifier's per-forward token budget (None: its default)
    max_prefill_backlog_s: float | None = None  # the verifier's bound on a new prompt's prefill queue (None: default)
    eagle_head: Path | None = None  # the eagle drafters' head directory (None: the one cached for the target)
    log_dir: Path = Path("/tmp/specdec-bench")


@dataclass
class ModelStack:
    """A started stack: the router's gRPC and HTTP addresses and every service (for pids and logs)."""

    grpc_address: str
    http_address: str
    services: dict[str, Service] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://{self.http_address}"

    def pids(self) -> dict[str, int]:
        return {name: service.process.pid for name, service in self.services.items()}


@contextlib.contextmanager
def model_stack(options: StackOptions) -> Iterator[ModelStack]:
    """Start verifier, drafters and router (models load in parallel); stop them all on exit."""
    gamma = ["--num-draft-tokens", str(options.num_draft_tokens)]
    with Services(options.log_dir) as services:
        placement = ["--device", options.device, "--dtype", options.dtype]
        verifier_args = ["--model", options.target, *placement]
        verifier_args += ["--torch-threads", str(options.verifier_threads)]
        if options.max_batch_tokens is not None:
            verifier_args += ["--max-batch-tokens", str(options.max_batch_tokens)]
        if options.max_prefill_backlog_s is not None:
            verifier_args += ["--max-prefill-backlog-s", str(options.max_prefill_backlog_s)]
        verifier = services.spawn("verifier", "verifier_service", verifier_args)
        drafters = []
        for kind in options.drafter_kinds:
            args = ["--kind", kind, "--target", options.target, "--torch-threads", str(options.drafter_threads)]
            args += [*gamma, *placement]
            if kind == "early-exit" and options.early_exit_layers is not None:
                args += ["--early-exit-layers", str(options.early_exit_layers)]
            if kind == "eagle" and options.eagle_head is not None:
                args += ["--draft-model", str(options.eagle_head)]
            drafters.append(services.spawn(f"drafter-{kind}", "drafter_service", args))
        router_args = ["--model", options.target, "--grpc-port", "0", "--http-port", "0", *gamma]
        router_args += ["--max-concurrent-requests", str(options.max_concurrent_requests)]
        router_args += ["--verifier", verifier.wait_ready()["address"]]
        if options.drafter_kinds:
            router_args += ["--default-drafter", options.drafter_kinds[0]]
        for drafter in drafters:
            router_args += ["--drafter", drafter.wait_ready()["address"]]
        router = services.start("router", "router", router_args)
        started = {"verifier": verifier, **{d.name: d for d in drafters}, "router": router}
        yield ModelStack(router.ready["grpc"], router.ready["http"], started)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (Linux ``/proc``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")
