"""When does waiting for more calls pay? The real scheduler (:class:`grpc_common.scheduler.BatchScheduler`) over a
fake forward, by waiting policy, cost model and arrival pattern. The policies: no wait (window 0), a fixed window
(``--windows-ms``), and the wait for the calls expected back (``--arrival-waits``, :mod:`grpc_common.arrivals`).

The forward sleeps ``cost(n)`` for a batch of ``n`` calls: ``flat`` (a GPU: ``--flat-ms`` whatever the batch) or
``linear`` (a CPU: ``--base-ms`` + ``--per-call-ms`` per call). ``--streams`` sequences are open; each keeps one
call in flight, and between a verdict and its next call spends the router's time:

- ``batched``: one router thread steps every stream together, as a router that sends one Batch per worker per
  tick: it waits for the verdicts of its tick, spends ``--router-ms``, and submits every next call in one
  :meth:`~grpc_common.scheduler.BatchScheduler.together` block (what a Batch RPC does);
- ``staggered``: one thread per stream, each submitting its next call after its own uniform ``0..--jitter-ms``
  (a router that handles replies one at a time, or clients that do not batch);
- ``pipelined``: one thread per stream; a share ``--hit-rate`` of its calls goes back at once (the pre-draft the
  verdict selected), the others after uniform ``--miss-ms`` (a fresh draft and the router's hops first).

Reported per configuration: rounds per second per stream (higher is better) and the mean batch of a forward.
Policies are interleaved within each (cost, arrivals, streams) cell. Writes ``NAME.json`` and ``NAME.md``.

    python -m bench.verifier_window --windows-ms 0,1,2,5 --arrival-waits 1 --streams 8,32 --seconds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.load.report import write_report
from grpc_common.arrivals import DEFAULT_FRACTION
from grpc_common.scheduler import BatchJob, BatchScheduler


@dataclass(frozen=True)
class Policy:
    """How the scheduler waits after a pass's first call: a fixed window, or for the calls it expects back."""

    window_ms: float = 0.0
    arrival_wait: float = 0.0

    @property
    def label(self) -> str:
        return f"arrival {self.arrival_wait:g}" if self.arrival_wait else f"window {self.window_ms:g} ms"


class SleepingForward(BatchScheduler[int]):
    """A scheduler whose forward of ``n`` calls sleeps ``cost(n)`` seconds."""

    def __init__(self, cost: Callable[[int], float], streams: int, window_s: float, arrival_wait: float) -> None:
        super().__init__("window-bench", max_batch_size=1024, batch_wait_s=window_s, arrival_wait=arrival_wait)
        self.cost = cost
        self.open = {f"s{index}" for index in range(streams)}
        self.forwards = self.calls = 0

    def _run_batch(self, jobs: list[BatchJob[int]]) -> None:
        time.sleep(self.cost(len(jobs)))
        self.forwards += 1
        self.calls += len(jobs)
        for job in jobs:
            job.future.set_result(None)

    def _open_sequences(self) -> Collection[str]:
        return self.open


def run(cost: Callable[[int], float], arrivals: str, streams: int, policy: Policy, args: argparse.Namespace) -> dict:
    scheduler = SleepingForward(cost, streams, policy.window_ms / 1000, policy.arrival_wait)
    scheduler.start()
    stop = time.monotonic() + args.seconds
    names = sorted(scheduler.open)

    def batched() -> None:
        while time.monotonic() < stop:
            with scheduler.together():
                futures = [scheduler.submit_batched(name, 0) for name in names]
            wait(futures)
            time.sleep(args.router_ms / 1000)

    def one(name: str, seed: int) -> None:
        generator = random.Random(seed)
        while time.monotonic() < stop:
            scheduler.submit_batched(name, 0).result()
            if arrivals == "staggered":
                time.sleep(generator.uniform(0, args.jitter_ms) / 1000)
            elif generator.random() >= args.hit_rate:  # pipelined: a missed pre-draft drafts before the next call
                time.sleep(generator.uniform(*args.miss_ms) / 1000)

    if arrivals == "batched":
        threads = [threading.Thread(target=batched)]
    else:
        threads = [threading.Thread(target=one, args=(name, index)) for index, name in enumerate(names)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    scheduler.stop()
    return {
        "rounds_per_s_per_stream": scheduler.calls / elapsed / streams,
        "mean_batch": scheduler.calls / scheduler.forwards if scheduler.forwards else None,
    }


def markdown(document: dict[str, Any]) -> str:
    labels = document["policies"]
    lines = [
        f"# bench.verifier_window {document['name']}",
        "",
        f"{document['date']} · {document['cpus']} CPUs (load {document['load_average']:.2f}) · "
        f"Command: `{' '.join(document['command'])}`",
        "",
        f"Cost models: flat {document['flat_ms']} ms per forward; linear {document['base_ms']} ms + "
        f"{document['per_call_ms']} ms per call. Batched arrivals: the router spends {document['router_ms']} ms "
        f"per tick; staggered: each stream waits uniform 0..{document['jitter_ms']} ms; pipelined: "
        f"{document['hit_rate']:.0%} of calls go back at once, the others after uniform "
        f"{document['miss_ms'][0]:g}..{document['miss_ms'][1]:g} ms. Rounds per second per stream (mean batch of a "
        "forward); best of each row in bold.",
        "",
        "| cost | arrivals | streams | " + " | ".join(labels) + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for row in document["rows"]:
        best = max(cell["rounds_per_s_per_stream"] for cell in row["by_policy"])
        cells = []
        for cell in row["by_policy"]:
            text = f"{cell['rounds_per_s_per_stream']:.1f} ({cell['mean_batch']:.1f})"
            cells.append(f"**{text}**" if cell["rounds_per_s_per_stream"] == best else text)
        lines.append(f"| {row['cost']} | {row['arrivals']} | {row['streams']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _numbers(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verifier_window", description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows-ms", type=_numbers, default=[0.0, 1.0, 2.0, 5.0], help="fixed windows (0: no wait)")
    parser.add_argument("--arrival-waits", type=_numbers, default=[DEFAULT_FRACTION], help="arrival-wait fractions")
    parser.add_argument("--streams", type=lambda text: [int(v) for v in _numbers(text)], default=[8, 32])
    parser.add_argument("--seconds", type=float, default=2.0, help="per configuration")
    parser.add_argument("--flat-ms", type=float, default=15.0)
    parser.add_argument("--base-ms", type=float, default=5.0)
    parser.add_argument("--per-call-ms", type=float, default=1.0)
    parser.add_argument("--router-ms", type=float, default=0.5)
    parser.add_argument("--jitter-ms", type=float, default=4.0)
    parser.add_argument("--hit-rate", type=float, default=0.16, help="pipelined: share of calls sent back at once")
    parser.add_argument("--miss-ms", type=_numbers, default=[3.0, 8.0], help="pipelined: LO,HI of the others' delay")
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="verifier-window")
    args = parser.parse_args(argv)
    costs: dict[str, Callable[[int], float]] = {
        "flat": lambda n: args.flat_ms / 1000,
        "linear": lambda n: (args.base_ms + args.per_call_ms * n) / 1000,
    }
    policies = [Policy(window_ms=window) for window in args.windows_ms]
    policies += [Policy(arrival_wait=fraction) for fraction in args.arrival_waits if fraction]
    rows = []
    for cost_name, cost in costs.items():
        for arrivals in ("batched", "staggered", "pipelined"):
            for streams in args.streams:
                by_policy = [run(cost, arrivals, streams, policy, args) for policy in policies]
                rows.append({"cost": cost_name, "arrivals": arrivals, "streams": streams, "by_policy": by_policy})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    document = {
        "name": args.name,
        "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": ["python", "-m", "bench.verifier_window", *(argv if argv is not None else sys.argv[1:])],
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        **{key: value for key, value in vars(args).items() if key not in ("result_dir", "name")},
        "policies": [policy.label for policy in policies],
        "rows": rows,
    }
    write_report(args.result_dir, args.name, document, markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
