"""Co-located sequential speculation vs disaggregated (sequential / pipelined / auto) serving, in one run.

Greedy, float32, the chat-templated prompts of ``bench/prompts/colocated.jsonl``, EOS honoured:

* **co-located**: our :class:`~specdec.engine.Engine` in this process, target-only and with the drafter
  (``--drafter-kind``: ngram, or eagle with its head; sequential rounds: draft, then verify);
* **disaggregated**: ``python -m verifier_service``, ``python -m drafter_service --kind KIND`` and
  ``python -m router`` started as subprocesses on 127.0.0.1 (no Ray), requests through the SDK with
  ``speculation`` = off / sequential / pipelined / auto.

Two load levels: one stream (requests one after another, configurations interleaved prompt by prompt
so drifting machine load hits all alike) and N concurrent streams (one :class:`~specdec.client.Client`
per stream; co-located runs static batches of N through ``Engine.generate``). Every configuration gets
warm-up requests that are not counted. Writes ``disaggregated.json`` and ``disaggregated.md``.

    python -m bench.disaggregated --max-tokens 64 --num-prompts 12 --output-dir bench/results

Per-round quantities and the router overhead are defined in :data:`DEFINITIONS` (also in the report).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import queue
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from specdec.distill.prompts import interleave_categories

MODES = ("off", "sequential", "pipelined", "auto")
REFERENCE = ("co-located", "off", 1)  # the outputs every configuration is compared with

DEFINITIONS = """\
- **tokens/s**: output tokens of the whole batch / wall time of the batch (one stream: the sum of the
  requests' end-to-end times; N streams: first request sent → last request finished).
- **E[N]**: tokens committed per round, measured (output tokens / rounds). **mean acc. len**: 1 + accepted
  draft tokens / rounds (DESIGN §7); in pipelined mode a hit round emits no bonus token, so E[N] is the
  one that counts.
- **draft / verify / state ms/round**: the workers' own timings from the final message's stats
  (`draft_ns`, `verify_ns`, `state_ns`) / `rounds`. They are the durations of the (batched) calls a request
  took part in, so with N streams they are per-call latencies, not exclusive busy time; verify includes the
  prompt's prefill (done with the first verification), amortised over the rounds.
- **hit rate**: pipeline hits / (hits + misses) (pipelined only).
- **wire B/round**: proposal bytes on the wire / rounds (pipelined: discarded chains included).
- **wall ms/round**: a request's end-to-end time (client-measured: send → final message) / its rounds,
  summed over requests (Σ e2e / Σ rounds). For a co-located static batch the engine's rounds are what a
  stream waits for, so it is taken from the stream active in every engine round (the one with most rounds):
  batch time / its rounds, with its draft/verify/state.
- **ms/token** = wall ms/round / E[N]; **bound** = max(draft, verify + state) / E[N] (DESIGN §4, per-round
  times as above); **÷ bound** = ms/token / bound (1.0 would be a perfect pipeline with no overhead).
- **overhead ms/round** = wall ms/round − exposed draft − verify − state, where exposed draft is the draft
  time the verifier had to wait for: all of it when rounds are sequential (co-located, `off`, `sequential`),
  and in `pipelined` only the fresh proposals (first round and after each miss), estimated as
  draft × (rounds − hits) / (rounds + misses) (every proposal assumed equally costly). Disaggregated, it is
  what the router and the wire add per round: gRPC calls and (de)serialisation, the router's event loop,
  the drafter `Commit` before a fresh proposal, the client stream, open/close of the sequences (amortised),
  and, with N streams, waiting in the workers' queues behind other requests' batches. Co-located, it is the
  engine's own bookkeeping per round.
"""


# --- records and the pure maths (tested in tests/test_bench_smoke.py) -----------------------------------------


@dataclass
class RequestRecord:
    """One request's outcome. ``timed``: counts in the per-round timing (see DEFINITIONS)."""

    prompt_index: int
    token_ids: list[int]
    e2e_s: float
    rounds: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    state_s: float = 0.0
    pipeline_hits: int = 0
    pipeline_misses: int = 0
    wire_bytes: int = 0
    ttft_s: float | None = None
    drafter_fallback: bool = False
    timed: bool = True


@dataclass
class Run:
    """One configuration at one load level: its requests and the batch's wall time."""

    side: str  # "co-located" or "disaggregated"
    mode: str  # "off", "sequential", "pipelined" or "auto"
    streams: int
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    drafter: str = "ngram"

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.side, self.mode, self.streams)

    @property
    def label(self) -> str:
        if self.side == "co-located":
            return "co-located target-only" if self.mode == "off" else f"co-located {self.drafter} (sequential)"
        return f"disaggregated {self.mode}" + ("" if self.mode == "off" else f" ({self.drafter})")


@dataclass(frozen=True)
class Summary:
    """The report's numbers for one :class:`Run` (times in ms, None where they do not apply)."""

    label: str
    side: str
    mode: str
    streams: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    rounds: int
    tokens_per_round: float
    mean_accepted_length: float
    acceptance_rate: float | None
    draft_ms_per_round: float
    verify_ms_per_round: float
    state_ms_per_round: float
    pipeline_hit_rate: float | None
    wire_bytes_per_round: float | None
    wall_ms_per_round: float
    exposed_draft_ms_per_round: float
    overhead_ms_per_round: float
    ms_per_token: float
    bound_ms_per_token: float
    ratio_to_bound: float
    ttft_ms_median: float | None
    drafter_fallbacks: int
    same_as_reference: int


def exposed_draft_fraction(mode: str, rounds: int, hits: int, misses: int) -> float:
    """Share of the measured draft time that the verifier waited for (see DEFINITIONS)."""
    if mode not in ("pipelined", "auto") or (mode == "auto" and hits + misses == 0):
        return 1.0  # `auto` pipelines only the rounds it predicts that pays in: counted as pipelined when it did
    proposals = rounds + misses  # a fresh one for each round not fed by a hit, a pre-draft per hit or miss
    return (rounds - hits) / proposals if proposals else 0.0


def per_round(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Σ-over-requests / Σ-rounds of the timed records, in ms; plus their E[N]."""
    timed = [r for r in records if r.timed and r.rounds]
    rounds = sum(r.rounds for r in timed)
    if not rounds:
        raise ValueError("no timed request completed a round")
    return {
        "rounds": rounds,
        "tokens_per_round": sum(len(r.token_ids) for r in timed) / rounds,
        "wall": 1e3 * sum(r.e2e_s for r in timed) / rounds,
        "draft": 1e3 * sum(r.draft_s for r in timed) / rounds,
        "verify": 1e3 * sum(r.verify_s for r in timed) / rounds,
        "state": 1e3 * sum(r.state_s for r in timed) / rounds,
        "hits": sum(r.pipeline_hits for r in timed),
        "misses": sum(r.pipeline_misses for r in timed),
    }


def summarize(run: Run, reference: Sequence[list[int]] | None = None) -> Summary:
    """The report row of ``run``; ``reference`` is the expected token ids by prompt index."""
    records = run.records
    tokens = sum(len(r.token_ids) for r in records)
    rounds = sum(r.rounds for r in records)
    drafted = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    hits = sum(r.pipeline_hits for r in records)
    misses = sum(r.pipeline_misses for r in records)
    timing = per_round(records)
    exposed = timing["draft"] * exposed_draft_fraction(run.mode, timing["rounds"], timing["hits"], timing["misses"])
    busy = timing["verify"] + timing["state"]
    e_n = timing["tokens_per_round"]
    bound = max(timing["draft"], busy) / e_n
    ms_per_token = timing["wall"] / e_n
    ttfts = [1e3 * r.ttft_s for r in records if r.ttft_s is not None]
    same = sum(reference is not None and r.token_ids == reference[r.prompt_index] for r in records)
    return Summary(
        label=run.label,
        side=run.side,
        mode=run.mode,
        streams=run.streams,
        requests=len(records),
        tokens=tokens,
        wall_s=run.wall_s,
        tokens_per_s=tokens / run.wall_s if run.wall_s else 0.0,
        rounds=rounds,
        tokens_per_round=tokens / rounds if rounds else 0.0,
        mean_accepted_length=1 + accepted / rounds if rounds else 0.0,
        acceptance_rate=accepted / drafted if drafted else None,
        draft_ms_per_round=timing["draft"],
        verify_ms_per_round=timing["verify"],
        state_ms_per_round=timing["state"],
        pipeline_hit_rate=hits / (hits + misses) if hits + misses else None,
        wire_bytes_per_round=(
            sum(r.wire_bytes for r in records) / rounds if run.side == "disaggregated" and rounds else None
        ),
        wall_ms_per_round=timing["wall"],
        exposed_draft_ms_per_round=exposed,
        overhead_ms_per_round=timing["wall"] - exposed - busy,
        ms_per_token=ms_per_token,
        bound_ms_per_token=bound,
        ratio_to_bound=ms_per_token / bound if bound else 0.0,
        ttft_ms_median=statistics.median(ttfts) if ttfts else None,
        drafter_fallbacks=sum(r.drafter_fallback for r in records),
        same_as_reference=same,
    )


def mark_batch_timing(records: Sequence[RequestRecord], elapsed_s: float) -> None:
    """A co-located static batch: only the stream with most rounds is timed, at the batch's time."""
    longest = max(records, key=lambda r: r.rounds)
    for record in records:
        record.timed = record is longest
        record.e2e_s = elapsed_s


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _shape(meta: dict) -> str:
    """``γ = 4``, or ``tree depth 3, width 3, 4 nodes`` (results written before trees were measured: a chain)."""
    width, budget = meta.get("tree_width", 1), meta.get("tree_budget", 0)
    if width <= 1:
        return f"γ = {meta['num_draft_tokens']}"
    return f"tree depth {meta['num_draft_tokens']}, width {width}, {budget or width * meta['num_draft_tokens']} nodes"


def markdown(summaries: Sequence[Summary], meta: dict) -> str:
    """The report: header with hardware and versions, one table row per run, the definitions."""
    baseline = {s.streams: s for s in summaries if (s.side, s.mode) == REFERENCE[:2]}
    identical = all(s.same_as_reference == s.requests for s in summaries)
    lines = [
        f"# Co-located vs disaggregated speculation on `{meta['target']}`",
        "",
        f"{meta['date']} · {meta['cpu']} ({meta['cpus']} CPUs, load average {meta['load_before']} before, "
        f"{meta['load_after']} after; the machine may be shared) · Python {meta['python']} · torch {meta['torch']} · "
        f"transformers {meta['transformers']} · grpcio {meta['grpcio']}",
        "",
        f"Models (co-located engine, verifier, drafter) on **{meta.get('device', 'cpu')}**"
        + (f" ({meta['gpu']})" if meta.get("gpu") else "")
        + ".",
        "",
        f"Greedy, float32, EOS honoured, max {meta['max_tokens']} new tokens, {_shape(meta)}, "
        f"{meta['num_prompts']} chat-templated prompts ({', '.join(meta['categories'])}), "
        f"{', '.join(str(n) for n in meta['streams'])} concurrent stream(s). Torch threads: co-located engine "
        f"{meta['threads']['colocated']}, verifier {meta['threads']['verifier']}, drafter "
        f"{meta['threads']['drafter']} (router and client: Python threads, no torch compute), so the verifier "
        "computes with what the co-located engine has and the second core serves the drafter, router and client.",
        "",
        f"Greedy outputs identical to co-located target-only (1 stream) in every configuration: "
        f"**{'yes' if identical else 'NO'}**.",
        "",
        "| streams | configuration | tokens | wall s | tokens/s | × target-only | E[N] | mean acc. len "
        "| draft ms/round | verify ms/round | state ms/round | hit rate | wire B/round | wall ms/round | ms/token "
        "| bound ms/token | ÷ bound | overhead ms/round | TTFT ms (median) | same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        base = baseline.get(s.streams)
        speedup = s.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s else None
        lines.append(
            f"| {s.streams} | {s.label} | {s.tokens} | {s.wall_s:.1f} | {s.tokens_per_s:.1f} | {_fmt(speedup)} | "
            f"{s.tokens_per_round:.2f} | {s.mean_accepted_length:.2f} | {s.draft_ms_per_round:.2f} | "
            f"{s.verify_ms_per_round:.1f} | {s.state_ms_per_round:.2f} | {_fmt(s.pipeline_hit_rate)} | "
            f"{_fmt(s.wire_bytes_per_round, '.0f')} | {s.wall_ms_per_round:.1f} | {s.ms_per_token:.1f} | "
            f"{s.bound_ms_per_token:.1f} | {s.ratio_to_bound:.2f} | {s.overhead_ms_per_round:.2f} | "
            f"{_fmt(s.ttft_ms_median, '.0f')} | {s.same_as_reference}/{s.requests} |"
        )
    fallbacks = sum(s.drafter_fallbacks for s in summaries)
    lines += ["", f"Requests that fell back to target-only after a drafter failure: {fallbacks}.", ""]
    lines += ["Definitions:", ""]
    return "\n".join(lines) + "\n" + DEFINITIONS


# --- running the configurations -------------------------------------------------------------------------------


def colocated_record(index: int, result) -> RequestRecord:  # result: specdec.engine.GenerationResult
    stats = result.stats
    return RequestRecord(
        prompt_index=index,
        token_ids=list(result.token_ids),
        e2e_s=result.elapsed_s,
        rounds=stats.rounds,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        draft_s=stats.draft_s,
        verify_s=stats.verify_s,
        state_s=stats.state_s,
    )


def sdk_record(client, index: int, prompt_ids: list[int], options: dict) -> RequestRecord:
    """One streamed request through the SDK: client-side TTFT and end-to-end time, the final stats."""
    started = time.perf_counter()
    ttft, tokens, last = None, [], None
    for chunk in client.stream(prompt_ids=prompt_ids, **options):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - started
        tokens.extend(chunk.token_ids)
        last = chunk
    e2e = time.perf_counter() - started
    if last is None or last.stats is None:
        raise RuntimeError(f"prompt {index}: the stream ended without a final message")
    stats = last.stats
    return RequestRecord(
        prompt_index=index,
        token_ids=tokens,
        e2e_s=e2e,
        rounds=stats.rounds,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        draft_s=stats.draft_s,
        verify_s=stats.verify_s,
        state_s=stats.state_s,
        pipeline_hits=stats.pipeline_hits,
        pipeline_misses=stats.pipeline_misses,
        wire_bytes=stats.wire_bytes,
        ttft_s=ttft,
        drafter_fallback=stats.drafter_fallback,
    )


class Bench:
    """Holds the co-located engines and the SDK clients; runs one configuration at a time."""

    def __init__(self, engines: dict, clients: list, max_tokens: int, shape: dict[str, int], drafter: str) -> None:
        self.engines = engines  # mode -> Engine ("off": target-only, "sequential": the drafter)
        self.clients = clients  # one per concurrent stream
        self.max_tokens = max_tokens
        self.shape = shape  # num_draft_tokens, tree_width, tree_budget: the requests' candidate shape
        self.drafter = drafter

    def options(self, mode: str) -> dict:
        options = {"max_tokens": self.max_tokens, "temperature": 0.0, "speculation": mode, "ignore_eos": False}
        if mode != "off":
            options |= {"drafter": self.drafter, **self.shape}
        return options

    def colocated(self, mode: str, batch: Sequence[tuple[int, list[int]]]) -> list[RequestRecord]:
        from specdec.engine import GenerationRequest
        from specdec.sampling import SamplingParams

        requests = [GenerationRequest(ids, SamplingParams(temperature=0.0), self.max_tokens) for _, ids in batch]
        results = self.engines[mode].generate(requests)
        return [colocated_record(index, result) for (index, _), result in zip(batch, results, strict=True)]

    def disaggregated(self, mode: str, index: int, prompt_ids: list[int], stream: int = 0) -> RequestRecord:
        return sdk_record(self.clients[stream], index, prompt_ids, self.options(mode))

    def warm_up(self, prompts: Sequence[tuple[int, list[int]]]) -> None:
        """Uncounted requests: every engine, every mode on every client (connects the channels)."""
        short = [(index, ids[:16]) for index, ids in prompts[:2]]
        for mode in self.engines:
            self.colocated(mode, short)
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            for mode in MODES:
                streams = [pool.submit(self.disaggregated, mode, 0, short[0][1], s) for s in range(len(self.clients))]
                for future in streams:
                    future.result()

    def single_stream(self, prompts: Sequence[tuple[int, list[int]]]) -> list[Run]:
        """One stream, configurations interleaved prompt by prompt; wall = Σ end-to-end times."""
        runs = [Run("co-located", mode, 1, drafter=self.drafter) for mode in self.engines]
        runs += [Run("disaggregated", mode, 1, drafter=self.drafter) for mode in MODES]
        for index, ids in prompts:
            for run in runs:
                if run.side == "co-located":
                    [record] = self.colocated(run.mode, [(index, ids)])
                else:
                    record = self.disaggregated(run.mode, index, ids)
                run.records.append(record)
                run.wall_s += record.e2e_s
        return runs

    def concurrent(self, prompts: Sequence[tuple[int, list[int]]], streams: int) -> list[Run]:
        """``streams`` at once: co-located static batches, disaggregated one client per stream."""
        runs = []
        for mode in self.engines:
            run = Run("co-located", mode, streams, drafter=self.drafter)
            for start in range(0, len(prompts), streams):
                batch = prompts[start : start + streams]
                began = time.perf_counter()
                records = self.colocated(mode, batch)
                elapsed = time.perf_counter() - began
                mark_batch_timing(records, elapsed)
                run.records += records
                run.wall_s += elapsed
            runs.append(run)
        for mode in MODES:
            run = Run("disaggregated", mode, streams, drafter=self.drafter)
            run.records, run.wall_s = self._streams(mode, prompts, streams)
            runs.append(run)
        return runs

    def _streams(self, mode: str, prompts: Sequence[tuple[int, list[int]]], streams: int):
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        for job in prompts:
            jobs.put(job)
        records: list[RequestRecord] = []

        def stream(number: int) -> None:
            while True:
                try:
                    index, ids = jobs.get_nowait()
                except queue.Empty:
                    return
                records.append(self.disaggregated(mode, index, ids, number))

        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            for future in [pool.submit(stream, number) for number in range(streams)]:
                future.result()
        wall = time.perf_counter() - began
        return sorted(records, key=lambda r: r.prompt_index), wall


# --- main -----------------------------------------------------------------------------------------------------


def _load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, help="first N prompts, categories in turn (default: all)")
    parser.add_argument("--num-draft-tokens", type=int, default=4, help="γ, the chain length (a tree's depth)")
    parser.add_argument("--tree-width", type=int, default=1, help="children per node (1: a chain)")
    parser.add_argument("--tree-budget", type=int, default=0, help="a tree's nodes (0: the width a level)")
    parser.add_argument("--drafter-kind", choices=("ngram", "eagle"), default="ngram", help="the drafter compared")
    parser.add_argument("--draft-model", help="eagle: the head directory (default: the head cached for --target)")
    parser.add_argument("--streams", default="1,8", help="comma-separated load levels (concurrent streams)")
    parser.add_argument("--device", default="cpu", help="torch device of every model (co-located and services)")
    parser.add_argument("--colocated-threads", type=int, default=1, help="torch threads of the co-located engine")
    parser.add_argument("--verifier-threads", type=int, default=1, help="torch threads of the verifier service")
    parser.add_argument("--drafter-threads", type=int, default=1, help="torch threads of the drafter service")
    parser.add_argument(
        "--verifier-batch-wait-ms", type=float, help="the verifier's --batch-wait-ms (default: the verifier's own)"
    )
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    parser.add_argument(
        "--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "specdec-bench", help="services' stderr logs"
    )
    args = parser.parse_args(argv)
    levels = sorted({int(n) for n in args.streams.split(",")})
    if 1 not in levels:
        levels.insert(0, 1)  # the reference outputs come from one co-located stream

    # Heavy imports here, so the pure helpers above load without torch (tests/test_bench_smoke.py).
    import grpc
    import torch
    import transformers

    from bench.colocated import PROMPTS, load_prompts
    from bench.load.report import cpu_model
    from bench.services import Services
    from specdec.cli import encode_prompt
    from specdec.client import Client
    from specdec.drafters import DraftConfig, build_drafter
    from specdec.engine import Engine
    from specdec.models import load_model, quiet_model_loading
    from specdec.runner import KVRunner

    torch.set_num_threads(args.colocated_threads)
    quiet_model_loading()
    load_before = _load()
    started = time.perf_counter()
    shape = {"num_draft_tokens": args.num_draft_tokens, "tree_width": args.tree_width, "tree_budget": args.tree_budget}
    with Services(args.log_dir) as services:
        gamma = ["--num-draft-tokens", str(args.num_draft_tokens)]
        on_device = ["--device", args.device]
        verifier = services.spawn(
            "verifier",
            "verifier_service",
            ["--model", args.target, "--dtype", "float32", *on_device, "--torch-threads", str(args.verifier_threads)]
            + ([] if args.verifier_batch_wait_ms is None else ["--batch-wait-ms", str(args.verifier_batch_wait_ms)]),
        )
        drafter_args = ["--kind", args.drafter_kind, "--target", args.target, *on_device, *gamma]
        drafter_args += ["--draft-model", args.draft_model] if args.draft_model else []
        drafter_args += ["--torch-threads", str(args.drafter_threads)]
        drafter = services.spawn("drafter", "drafter_service", drafter_args)
        target = load_model(args.target, device=args.device)  # meanwhile, the co-located side
        rows = interleave_categories(load_prompts(PROMPTS, None), args.num_prompts)
        prompts = [(index, encode_prompt(target, row["prompt"], chat=True)) for index, row in rows]
        engines = {
            "off": Engine(KVRunner(target.model), target.eos_token_ids),
            "sequential": Engine(
                KVRunner(target.model),
                target.eos_token_ids,
                build_drafter(
                    args.drafter_kind,
                    target,
                    DraftConfig(**shape),
                    draft_model=args.draft_model,
                ),
            ),
        }
        router_args = ["--model", args.target, "--grpc-port", "0", "--http-port", "0", *gamma]
        router_args += ["--verifier", verifier.wait_ready()["address"], "--drafter", drafter.wait_ready()["address"]]
        router = services.start("router", "router", router_args)
        print(f"services ready after {time.perf_counter() - started:.0f} s: {router.ready}", flush=True)

        clients = [Client(router.ready["grpc"], timeout_s=600) for _ in range(max(levels))]
        try:
            bench = Bench(engines, clients, args.max_tokens, shape, args.drafter_kind)
            bench.warm_up(prompts)
            runs: list[Run] = []
            for streams in levels:
                level_started = time.perf_counter()
                runs += bench.single_stream(prompts) if streams == 1 else bench.concurrent(prompts, streams)
                print(f"{streams} stream(s) done in {time.perf_counter() - level_started:.0f} s", flush=True)
        finally:
            for client in clients:
                client.close()

    reference_run = next(run for run in runs if run.key == REFERENCE)
    reference: list[list[int]] = [[] for _ in range(max(index for index, _ in prompts) + 1)]
    for record in reference_run.records:
        reference[record.prompt_index] = record.token_ids
    summaries = [summarize(run, reference) for run in runs]
    meta = {
        "target": args.target,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_before": load_before,
        "load_after": _load(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
        "max_tokens": args.max_tokens,
        "num_draft_tokens": args.num_draft_tokens,
        "tree_width": args.tree_width,
        "tree_budget": args.tree_budget,
        "num_prompts": len(prompts),
        "categories": sorted({row["category"] for _, row in rows}),
        "streams": levels,
        "threads": {
            "colocated": args.colocated_threads,
            "verifier": args.verifier_threads,
            "drafter": args.drafter_threads,
        },
        "dtype": "float32",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "sampling": "greedy",
        "ignore_eos": False,
        "total_s": round(time.perf_counter() - started, 1),
    }
    report = markdown(summaries, meta)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "disaggregated.md").write_text(report)
    payload = {
        "meta": meta,
        "definitions": DEFINITIONS,
        "summaries": [asdict(s) for s in summaries],
        "requests": {
            f"{run.side}/{run.mode}/{run.streams}": [_record_json(r, reference) for r in run.records] for run in runs
        },
    }
    (args.output_dir / "disaggregated.json").write_text(json.dumps(payload, indent=2) + "\n")
    print(report)


def _record_json(record: RequestRecord, reference: Sequence[list[int]]) -> dict:
    row = asdict(record)
    row["tokens"] = len(row.pop("token_ids"))
    row["same_as_reference"] = record.token_ids == reference[record.prompt_index]
    return row


if __name__ == "__main__":
    main()
