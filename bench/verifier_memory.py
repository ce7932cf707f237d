"""Accelerated, deterministic reproduction of the verifier's RSS creep in the soak (no real-time arrivals).

Drives the verifier closed-loop with the soak's prompt distribution (``bench/prompts/load.jsonl`` through the chat
template, a seeded shuffle), ``--concurrency`` requests at a time, each a few greedy rounds of n-gram proposals
(prompt lookup over prompt + emitted, as the n-gram drafter does) with ``defer_bonus`` set, every prompt chunk-
prefilled under ``--max-batch-tokens``; every ``--cancel-every``-th request is closed while its first Verify is still
in flight (mid-prefill for a long prompt). After every ``--every`` requests the driver lets the open requests finish
and samples the verifier's RSS while nothing is open: the idle floor, which is what a leak raises.

Two ways to reach the verifier:

- ``--mode inproc``: the service's own scheduler, batch verifier and runner in this process (its RSS is sampled);
  ``--tracemalloc`` adds Python-allocation snapshot diffs and every sample counts live tensors and open sequences.
- ``--mode grpc``: ``python -m verifier_service`` as a subprocess over its public gRPC API (the child's RSS);
  ``--verifier-arg=--malloc-trim-idle-s=0`` turns the service's idle trim off.

``--trim-idle-s`` gives the in-process scheduler the service's idle trim (:mod:`grpc_common.memory`) and reports
how long each trim took; ``--mode cost`` times a fixed sequence of runner forwards and a ``malloc_trim(0)`` after
them (run it with and without ``MALLOC_MMAP_THRESHOLD_`` to price a fixed mmap threshold).

Allocator settings (``MALLOC_*``) are environment variables read at process start, so each variant is its own run:

    MALLOC_MMAP_THRESHOLD_=131072 python -m bench.verifier_memory --mode grpc --requests 200 --json /tmp/v.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grpc_common.memory import IdleTrim, glibc_malloc_trim
from specdec.drafters.base import Proposal
from specdec.lookup import lookup_continuation
from specdec.model_files import load_tokenizer
from specdec.models import load_model
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification import VerifyCall

MIB = 1024 * 1024
PROMPTS = Path(__file__).parent / "prompts" / "load.jsonl"
GREEDY = SamplingParams(temperature=0.0)  # the soak's requests


def rss_mib(pid: int) -> float:
    """VmRSS of ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for pid {pid}")


@dataclass
class _Request:
    index: int
    sequence_id: str
    text: list[int]
    rounds_left: int
    cancel: bool
    cancel_at: int | None = None  # completions count at which the cancel-marked request is closed
    future: Future | None = None
    first: bool = True


def relay_verdict(result: Future) -> Callable[[Any], None]:
    """A done-callback for a Verify future (in-process or gRPC) that settles ``result`` with (emitted, finished)."""

    def done(call: Any) -> None:
        error = call.exception()
        if error is not None:
            result.set_exception(error)
        else:
            verdict = call.result().verdict
            result.set_result((list(verdict.emitted), verdict.finished))

    return done


@dataclass
class Backend:
    """Open / Verify / Close of one verifier; ``verify`` returns a Future of ``(emitted, finished)``."""

    pid: int
    open: Callable[[str, list[int], int], None]
    verify: Callable[[str, Proposal], Future]
    close: Callable[[str], None]
    idle: Callable[[], dict] = field(default=lambda: {})  # extra numbers sampled at each idle point
    stop: Callable[[], None] = field(default=lambda: None)


def inproc_backend(args: argparse.Namespace) -> Backend:
    """The verifier service's scheduler over a batch verifier over a KV runner, in this process."""
    from specdec.runner import KVRunner
    from specdec.verification import BatchVerifier
    from verifier_service.scheduler import VerifyScheduler

    model = load_model(args.model, dtype=torch.float32)
    verifier = BatchVerifier(KVRunner(model.model), max_sequences=256)
    malloc_trim = glibc_malloc_trim()
    trim_ms: list[float] = []

    def timed_trim() -> None:
        started = time.perf_counter()
        malloc_trim()
        trim_ms.append((time.perf_counter() - started) * 1e3)

    scheduler = VerifyScheduler(
        verifier,
        max_batch_size=32,
        max_queued=256,
        batch_wait_s=0.005,
        max_batch_tokens=args.max_batch_tokens,
        idle_trim=IdleTrim(args.trim_idle_s, timed_trim),
    )
    scheduler.start()
    eos = model.eos_token_ids
    snapshots: list[tracemalloc.Snapshot] = []

    def open_(sequence_id: str, prompt: list[int], max_tokens: int) -> None:
        scheduler.open(sequence_id, prompt, GREEDY, 0, max_tokens, eos, False, False).result()

    def verify(sequence_id: str, proposal: Proposal) -> Future:
        result: Future = Future()
        scheduler.verify(VerifyCall(sequence_id, proposal, defer_bonus=True)).add_done_callback(relay_verdict(result))
        return result

    def idle() -> dict:
        gc.collect()
        with warnings.catch_warnings():  # isinstance() touches deprecated torch attributes of some objects
            warnings.simplefilter("ignore")
            tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
        status = scheduler.status().result()
        numbers = {
            "tensors": len(tensors),
            "tensor_mib": sum(t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu") / MIB,
            "open": status.open_sequences,
            "runner_open": status.runner_sequences,
            "carried": len(scheduler._carried),
            "trims": len(trim_ms),
            "trim_ms_max": round(max(trim_ms, default=0.0), 2),
        }
        if tracemalloc.is_tracing():
            numbers["traced_mib"] = tracemalloc.get_traced_memory()[0] / MIB
            snapshots.append(tracemalloc.take_snapshot())
        return numbers

    def stop() -> None:
        scheduler.stop()
        if len(snapshots) > 2:  # the growth of Python allocations from the sample after the first to the last
            for stat in snapshots[-1].compare_to(snapshots[2], "traceback")[:12]:
                print(f"tracemalloc {stat.size_diff / 1024:+.1f} KiB {stat.count_diff:+d} blocks", file=sys.stderr)
                print("    " + "\n    ".join(stat.traceback.format()[-4:]), file=sys.stderr)

    return Backend(os.getpid(), open_, verify, lambda sid: scheduler.close(sid).result(), idle, stop)


def grpc_backend(args: argparse.Namespace) -> Backend:
    """``python -m verifier_service`` as a child process (inheriting this environment) over gRPC."""
    import grpc
    from specdec_wire.v1 import verifier_pb2, verifier_pb2_grpc

    from grpc_common.convert import sampling_to_wire
    from grpc_common.convert_rows import proposal_to_wire

    command = [sys.executable, "-m", "verifier_service", "--model", args.model, "--dtype", "float32"]
    command += ["--torch-threads", "1", "--max-batch-tokens", str(args.max_batch_tokens), *args.verifier_arg]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = json.loads(process.stdout.readline())
    channel = grpc.insecure_channel(ready["address"])
    stub = verifier_pb2_grpc.VerifierStub(channel)
    sampling = sampling_to_wire(GREEDY)

    def open_(sequence_id: str, prompt: list[int], max_tokens: int) -> None:
        stub.OpenSequence(
            verifier_pb2.OpenVerifyRequest(
                sequence_id=sequence_id, prompt_ids=prompt, sampling=sampling, seed=0, max_tokens=max_tokens
            )
        )

    def verify(sequence_id: str, proposal: Proposal) -> Future:
        result: Future = Future()
        request = verifier_pb2.VerifyRequest(
            sequence_id=sequence_id, proposal=proposal_to_wire(proposal), defer_bonus=True
        )
        stub.Verify.future(request, timeout=600).add_done_callback(relay_verdict(result))
        return result

    def close(sequence_id: str) -> None:
        stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=sequence_id))

    def stop() -> None:
        channel.close()
        process.terminate()
        process.wait(30)

    return Backend(process.pid, open_, verify, close, stop=stop)


def prompt_ids(model: str, seed: int) -> list[list[int]]:
    """The load prompts through the chat template, in a seeded shuffle (the bench's :class:`PromptCycle` order)."""
    tokenizer = load_tokenizer(model)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for row in rows
    ]
    order = np.random.default_rng(seed).permutation(len(ids))
    return [list(ids[int(i)]) for i in order]


def run(args: argparse.Namespace, backend: Backend) -> list[dict]:
    """Closed loop over ``args.requests`` requests; returns the idle samples."""
    prompts = prompt_ids(args.model, args.seed)
    trim = ctypes.CDLL("libc.so.6").malloc_trim if args.driver_trim else None
    samples: list[dict] = []
    started_at = time.monotonic()

    def sample(done: int) -> None:
        time.sleep(args.settle_s)  # long enough for the scheduler's idle trim, when it has one
        if trim is not None:
            trim(0)
        point = {"requests": done, "t": round(time.monotonic() - started_at, 1), "rss_mib": rss_mib(backend.pid)}
        point.update(backend.idle())
        samples.append(point)
        print(json.dumps(point), file=sys.stderr, flush=True)

    sample(0)
    active: dict[str, _Request] = {}
    started = done = completions = 0
    draining = False
    next_sample = args.every

    def submit(request: _Request) -> None:
        draft = lookup_continuation(request.text, 3, 1, args.num_draft_tokens)
        request.future = backend.verify(request.sequence_id, Proposal(TokenTree.chain(draft), None))
        if request.cancel and request.first:
            request.cancel_at = completions + 2

    def finish(request: _Request) -> None:
        nonlocal done
        backend.close(request.sequence_id)
        del active[request.sequence_id]
        done += 1

    while done < args.requests:
        while not draining and len(active) < args.concurrency and started < args.requests:
            prompt = prompts[started % len(prompts)]
            cancel = args.cancel_every > 0 and started % args.cancel_every == args.cancel_every - 1
            request = _Request(started, f"r{started}", list(prompt), args.rounds, cancel)
            backend.open(request.sequence_id, prompt, args.max_tokens)
            active[request.sequence_id] = request
            submit(request)
            started += 1
        wait([r.future for r in active.values()], return_when=FIRST_COMPLETED)
        for request in list(active.values()):
            if request.future.done():
                completions += 1
                error = request.future.exception()
                request.rounds_left -= 1
                if error is None:
                    emitted, finished = request.future.result()
                    request.text += emitted
                    request.first = False
                if error is not None or finished or request.rounds_left == 0 or request.cancel:
                    finish(request)
                else:
                    submit(request)
            elif request.cancel_at is not None and completions >= request.cancel_at:
                request.cancel_at = None
                backend.close(request.sequence_id)  # its Verify fails as a call to an unknown sequence
        if done >= next_sample and done < args.requests:
            draining = True  # start nothing new until the open requests finish
        if draining and not active:
            sample(done)
            draining, next_sample = False, done + args.every
    next_sample = args.every
    sample(done)
    return samples


def summary(samples: list[dict], warmup: int) -> dict:
    """Start, after warm-up, end (MiB) and the least-squares slope per 100 requests over the post-warm-up samples."""
    late = [s for s in samples if s["requests"] >= warmup] or samples
    x = np.array([s["requests"] for s in late], dtype=float)
    y = np.array([s["rss_mib"] for s in late], dtype=float)
    slope = float(np.polyfit(x, y, 1)[0] * 100) if len(late) > 1 and np.ptp(x) > 0 else 0.0
    return {
        "start": samples[0]["rss_mib"],
        "warm": late[0]["rss_mib"],
        "end": samples[-1]["rss_mib"],
        "max_idle": max(s["rss_mib"] for s in samples),
        "slope_per_100": round(slope, 2),
    }


def forward_cost(args: argparse.Namespace) -> dict:
    """Seconds of a fixed, soak-like sequence of runner forwards (chunked prefills of a long, a medium and a short
    prompt, then decode rounds of 5 positions), ``--repeat`` times, and what ``malloc_trim(0)`` then takes."""
    from specdec.runner import ForwardItem, KVRunner

    runner = KVRunner(load_model(args.model, dtype=torch.float32).model)
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    times, trims = [], []
    for _ in range(args.repeat):
        started = time.perf_counter()
        for length in (2800, 700, 300, 60):
            seq = runner.open()
            for start in range(0, length, args.max_batch_tokens):
                chunk = list(range(100 + start, 100 + min(length, start + args.max_batch_tokens)))
                runner.forward([ForwardItem(seq, chunk)])
                runner.commit(seq, len(chunk))
            for token in range(8):
                runner.forward([ForwardItem(seq, [token + 7], TokenTree.chain([11, 12, 13, 14]))])
                runner.commit(seq, 1, [0, 1])
            runner.close(seq)
        times.append(time.perf_counter() - started)
        started = time.perf_counter()
        trim(0)
        trims.append(time.perf_counter() - started)
        print(json.dumps({"forward_s": times[-1], "trim_ms": trims[-1] * 1e3, "rss_mib": rss_mib(os.getpid())}))
    return {"forward_s": times, "trim_ms": [t * 1e3 for t in trims]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verifier_memory", description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("inproc", "grpc", "cost"), default="inproc")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4, help="Verify calls per request at most")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--cancel-every", type=int, default=7)
    parser.add_argument("--every", type=int, default=20, help="sample the idle RSS after this many requests")
    parser.add_argument("--warmup", type=int, default=40, help="requests before the slope's first sample")
    parser.add_argument("--settle-s", type=float, default=2.0, help="idle wait before each sample")
    parser.add_argument("--trim-idle-s", type=float, default=0.0, help="inproc: the scheduler's idle trim (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tracemalloc", action="store_true", help="inproc: diff Python allocations, warm-up vs end")
    parser.add_argument("--driver-trim", action="store_true", help="inproc: malloc_trim(0) before each sample")
    parser.add_argument("--verifier-arg", action="append", default=[], help="grpc: extra verifier_service flag")
    parser.add_argument("--repeat", type=int, default=3, help="cost: passes over the fixed forwards")
    parser.add_argument("--json", type=Path, help="write the samples and summary here")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.mode == "cost":
        print(json.dumps(forward_cost(args)))
        return 0
    backend = inproc_backend(args) if args.mode == "inproc" else grpc_backend(args)
    if args.tracemalloc and args.mode == "inproc":
        tracemalloc.start(8)  # after the model loads: tracing the GGUF conversion takes many minutes
    try:
        samples = run(args, backend)
    finally:
        backend.stop()
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "samples": samples}
    result["summary"] = summary(samples, args.warmup)
    result["env"] = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "ONEDNN_", "SPECDEC_"))}
    print(json.dumps(result["summary"]))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
