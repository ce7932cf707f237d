"""Soak: the real stack at a fixed QPS for minutes; 0 errors, 0 timeouts, p95 within the SLO, memory flat.

Starts :func:`bench.stack.model_stack` (verifier, one drafter of ``--drafter``'s kind, default n-gram, and router as
loopback subprocesses), runs ``specdec bench`` against it at ``--qps`` (Poisson arrivals) for ``--duration`` seconds
while a thread samples every service's resident memory, then writes ``NAME.json`` / ``NAME.md`` (the bench's own
report) and ``NAME-memory.json`` / ``NAME-memory.md`` (RSS series and the verdict) into ``--result-dir``.

    python -m bench.soak --qps 0.4 --duration 600 --slo-ttft-ms 2000 --slo-itl-ms 500

Memory counts as flat when, for every service, the floor of its RSS (the lowest sample) over the last
``FLOOR_WINDOW_S`` is less than ``--rss-tolerance-mb`` above the floor over the same span starting one minute in
(after warm-up and the first allocations of caches and pools). A verifier's RSS swings by hundreds of MiB and sits
on plateaus for minutes with the KV caches and forward activations of the requests in flight, so one sample minus
another, or a line fitted through plateaus, measures where the load happened to be; memory that is never freed
raises the floor for good. The report also gives the end minus the 1-minute sample and the least-squares rise.
``--rescore NAME-memory.json`` recomputes the report from saved samples.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.stack import StackOptions, model_stack, rss_bytes

MIB = 1024 * 1024
SETTLE_S = 60.0  # RSS baseline: this long after the measured run starts
FLOOR_WINDOW_S = 120.0  # RSS floors compared: this long after SETTLE_S and this long before the end


@dataclass(frozen=True)
class MemoryVerdict:
    """One service's memory over the soak, in MiB: ``baseline`` at SETTLE_S, ``end`` at the last sample."""

    service: str
    start: float
    baseline: float
    end: float
    peak: float
    trend: float = 0.0  # rise of the least-squares line through the samples from SETTLE_S to the end
    floor_rise: float = 0.0  # lowest RSS in the last FLOOR_WINDOW_S minus the lowest in the first after SETTLE_S

    @property
    def growth(self) -> float:
        return self.end - self.baseline


def memory_verdicts(samples: list[dict], settle_s: float = SETTLE_S) -> list[MemoryVerdict]:
    """Per service: RSS at the first sample, at the first sample ≥ ``settle_s``, at the last, and the peak.

    ``samples`` are ``{"t": seconds since start, "rss": {service: bytes}}`` in time order.
    """
    if not samples:
        return []
    settled = next((s for s in samples if s["t"] >= settle_s), samples[-1])
    verdicts = []
    for service in samples[0]["rss"]:
        series = [s["rss"][service] / MIB for s in samples if service in s["rss"]]
        late = [(s["t"], s["rss"][service] / MIB) for s in samples if service in s["rss"] and s["t"] >= settled["t"]]
        verdicts.append(
            MemoryVerdict(
                service,
                series[0],
                settled["rss"][service] / MIB,
                series[-1],
                max(series),
                fitted_rise(late),
                floor_rise(late),
            )
        )
    return verdicts


def floor_rise(points: list[tuple[float, float]], window_s: float = FLOOR_WINDOW_S) -> float:
    """Lowest value in the last ``window_s`` of ``(t, value)`` points minus the lowest in their first ``window_s``."""
    if not points:
        return 0.0
    first, last = points[0][0], points[-1][0]
    early = min(v for t, v in points if t <= first + window_s)
    late = min(v for t, v in points if t >= last - window_s)
    return late - early


def fitted_rise(points: list[tuple[float, float]]) -> float:
    """Rise over its span of the least-squares line through ``(t, value)`` points (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread
    return slope * (points[-1][0] - points[0][0])


class MemorySampler(threading.Thread):
    """Samples the RSS of ``pids`` every ``interval_s`` until stopped."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[dict] = []
        self._done = threading.Event()
        self._origin = time.monotonic()

    def run(self) -> None:
        while True:
            rss = {}
            for name, pid in self.pids.items():
                try:
                    rss[name] = rss_bytes(pid)
                except (OSError, ValueError):
                    continue  # the process is gone: the bench's errors will say why
            self.samples.append({"t": round(time.monotonic() - self._origin, 1), "rss": rss})
            if self._done.wait(self.interval_s):
                return

    def stop(self) -> list[dict]:
        self._done.set()
        self.join()
        return self.samples


def memory_markdown(verdicts: list[MemoryVerdict], tolerance_mb: float, bench: dict, slo: dict) -> str:
    lines = [
        "| service | RSS start MiB | at 1 min | end | peak | end − 1 min | least-squares rise | floor rise | flat |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        flat = "yes" if v.floor_rise < tolerance_mb else "NO"
        sizes = f"{v.start:.0f} | {v.baseline:.0f} | {v.end:.0f} | {v.peak:.0f}"
        rises = f"{v.growth:+.1f} | {v.trend:+.1f} | {v.floor_rise:+.1f}"
        lines.append(f"| {v.service} | {sizes} | {rises} | {flat} |")
    p95_ttft, p95_itl = bench.get("p95_ttft_ms"), bench.get("p95_itl_ms")
    checks = [
        f"- completed {bench.get('completed')}, failed {bench.get('failed')}, timeouts {bench.get('timeouts')}",
        f"- p95 TTFT {p95_ttft:.0f} ms (SLO {slo['ttft_ms']:.0f} ms): "
        + ("within" if p95_ttft <= slo["ttft_ms"] else "OVER"),
        f"- p95 ITL {p95_itl:.0f} ms (SLO {slo['itl_ms']:.0f} ms): "
        + ("within" if p95_itl <= slo["itl_ms"] else "OVER"),
        f"- memory flat (RSS floor over the last {FLOOR_WINDOW_S / 60:g} min < {tolerance_mb:.0f} MiB above the"
        f" floor over minutes 1-{(SETTLE_S + FLOOR_WINDOW_S) / 60:g}, every service): "
        + ("yes" if all(v.floor_rise < tolerance_mb for v in verdicts) else "NO"),
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(checks) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qps", type=float, help="the configuration's measured target QPS (required)")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, help="the verifier's per-forward token budget")
    parser.add_argument(
        "--max-prefill-backlog-s", type=float, help="the verifier's bound on a new prompt's prefill queue (0: none)"
    )
    parser.add_argument("--speculation", default="pipelined")
    parser.add_argument("--drafter", default="ngram", help="the drafter kind the stack serves (ngram, eagle, ...)")
    parser.add_argument("--eagle-head", type=Path, help="with --drafter eagle: its head (default: the cached one)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--slo-ttft-ms", type=float, help="(required)")
    parser.add_argument("--slo-itl-ms", type=float, help="(required)")
    parser.add_argument("--rss-tolerance-mb", type=float, default=20.0)
    parser.add_argument("--sample-interval", type=float, default=5.0)
    parser.add_argument("--result-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", default="soak")
    parser.add_argument("--prompts", type=Path, help="default: the bench's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rescore", type=Path, help="recompute the report from a saved NAME-memory.json; no run")
    args = parser.parse_args(argv)
    if args.rescore is not None:
        saved = json.loads(args.rescore.read_text())
        name = args.rescore.name.removesuffix("-memory.json")
        return write_memory_report(args.rescore.parent, name, saved["samples"], args.rss_tolerance_mb, saved)
    if args.qps is None or args.slo_ttft_ms is None or args.slo_itl_ms is None:
        parser.error("--qps, --slo-ttft-ms and --slo-itl-ms are required for a run")

    options = StackOptions(
        drafter_kinds=(args.drafter,),
        max_batch_tokens=args.max_batch_tokens,
        max_prefill_backlog_s=args.max_prefill_backlog_s,
        eagle_head=args.eagle_head,
    )
    with model_stack(options) as stack:
        sampler = MemorySampler(stack.pids(), args.sample_interval)
        specdec = str(Path(sys.executable).with_name("specdec"))
        command = [specdec, "bench", "--backend", "grpc", "--router", stack.grpc_address]
        command += ["--base-url", stack.base_url, "--qps", str(args.qps), "--arrival", "poisson"]
        command += ["--duration", str(args.duration), "--warmup", "4", "--max-tokens", str(args.max_tokens)]
        command += ["--speculation", args.speculation, "--seed", str(args.seed), "--no-progress"]
        command += ["--drafter", args.drafter, "--temperature", str(args.temperature)]
        command += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms)]
        command += ["--result-dir", str(args.result_dir), "--name", args.name]
        if args.prompts:
            command += ["--prompts", str(args.prompts)]
        sampler.start()
        status = subprocess.call(command)
        samples = sampler.stop()
    if status != 0:
        print(f"specdec bench exited with status {status}", file=sys.stderr)
        return status

    slo = {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms}
    command = " ".join(["python -m bench.soak", *(sys.argv[1:] if argv is None else argv)])
    run = {"qps": args.qps, "duration_s": args.duration, "slo": slo, "command": command}
    return write_memory_report(args.result_dir, args.name, samples, args.rss_tolerance_mb, run)


def write_memory_report(result_dir: Path, name: str, samples: list[dict], tolerance_mb: float, run: dict) -> int:
    """``NAME-memory.md`` / ``.json`` from the RSS ``samples`` and the bench's ``NAME.json``; prints the report."""
    bench = json.loads((result_dir / f"{name}.json").read_text())
    verdicts = memory_verdicts(samples)
    header = f"# Soak: {run['qps']:g} QPS for {run['duration_s']:g} s\n\n"
    if run.get("command"):
        header += f"Command: `{run['command']}`; bench report: `{name}.md`.\n\n"
    report = header + memory_markdown(verdicts, tolerance_mb, bench, run["slo"])
    (result_dir / f"{name}-memory.md").write_text(report)
    payload = {
        "qps": run["qps"],
        "duration_s": run["duration_s"],
        "slo": run["slo"],
        "rss_tolerance_mb": tolerance_mb,
        "command": run.get("command"),
        "samples": samples,
        "verdicts": [{**v.__dict__, "growth": v.growth} for v in verdicts],
    }
    (result_dir / f"{name}-memory.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
