"""Leases on worker sequences (DESIGN §9): a worker reclaims a sequence no call has named for its idle timeout, and a
live router renews the leases of the sequences it keeps waiting.

The mechanism is the shared scheduler's (:mod:`grpc_common.scheduler`), so it is tested once over a fake worker,
then on the real drafter and verifier servers with tiny models: kept alive by a router's keepalive, reclaimed once
it stops, and, as an operator would see it, after SIGKILL of a ``python -m router`` process with streams in flight.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import grpc
import pytest
from specdec_wire.v1 import (
    common_pb2,
    drafter_pb2,
    drafter_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    verifier_pb2,
    verifier_pb2_grpc,
)

from drafter_service.config import DrafterConfig
from drafter_service.server import RunningDrafter, start_drafter
from grpc_common.scheduler import BatchJob, BatchScheduler
from router.config import RouterConfig
from router.pipeline import SequenceSpec
from router.requests import DraftShape
from router.workers import WorkerPool
from specdec.models import LoadedModel
from specdec.sampling import SamplingParams
from tests.test_router_process import REPO, environment
from tests.tiny_models import tiny_llama
from verifier_service.config import VerifierConfig
from verifier_service.server import RunningVerifier, start_verifier

IDLE_S = 1.0  # the workers' lease in these tests
KEEPALIVE_S = 0.2  # the router's renewal period
TIMEOUT_S = 30


class LeasedWorker(BatchScheduler[object]):
    """Open sequences are a set; a batched job holds the scheduler thread until ``release`` is set."""

    def __init__(self, open_sequences: Collection[str], **kwargs) -> None:
        super().__init__("leased", max_batch_size=8, **kwargs)
        self.open = set(open_sequences)
        self.reclaimed: list[str] = []
        self.release = threading.Event()

    def _run_batch(self, jobs: list[BatchJob[object]]) -> None:
        self.release.wait(TIMEOUT_S)
        for job in jobs:
            job.future.set_result(None)

    def _open_sequences(self) -> Collection[str]:
        return self.open

    def _reclaim(self, sequence_id: str) -> None:
        self.open.discard(sequence_id)
        self.reclaimed.append(sequence_id)


def wait_until(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``condition()`` held (polled every 50 ms); fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not reached in time"
        time.sleep(0.05)
    return time.monotonic() - started


def test_an_idle_sequence_is_reclaimed_and_a_touched_or_served_one_is_not() -> None:
    """``long``'s forward holds the thread for twice the lease while ``queued``'s job waits behind it: neither is
    idle when it ends; ``idle`` is reclaimed at the first check after it, ``touched`` never while touched."""
    lease = 0.6
    worker = LeasedWorker({"idle", "touched", "long", "queued"}, idle_timeout_s=lease)
    worker.touch(worker.open)  # as the jobs that opened them would have
    worker.start()
    try:
        long = worker.submit_batched("long", "a forward of 2 leases")
        time.sleep(0.1)
        queued = worker.submit("queued", lambda: None)
        deadline = time.monotonic() + 2 * lease
        while time.monotonic() < deadline:
            worker.touch(["touched"])
            time.sleep(0.05)
        worker.release.set()
        long.result(TIMEOUT_S)
        queued.result(TIMEOUT_S)
        time.sleep(lease / 3)
        assert worker.reclaimed == ["idle"] and worker.open == {"touched", "long", "queued"}
        wait_until(lambda: not worker.open, 2 * lease)  # nothing names them any more
        assert sorted(worker.reclaimed) == ["idle", "long", "queued", "touched"]
    finally:
        worker.release.set()
        worker.stop()


def test_a_scheduler_without_leases_reclaims_nothing() -> None:
    worker = LeasedWorker({"a"})
    worker.start()
    try:
        time.sleep(0.3)
        assert worker.reclaimed == [] and worker.open == {"a"}
    finally:
        worker.stop()


@dataclass
class Workers:
    verifier: RunningVerifier
    drafter: RunningDrafter

    def open_sequences(self) -> tuple[int, int]:
        """(verifier, drafter) open sequences, from their Status RPCs."""
        with grpc.insecure_channel(self.verifier.address) as channel:
            verifier = verifier_pb2_grpc.VerifierStub(channel).Status(
                verifier_pb2.VerifierStatusRequest(), timeout=TIMEOUT_S
            )
        with grpc.insecure_channel(self.drafter.address) as channel:
            drafter = drafter_pb2_grpc.DrafterStub(channel).Status(
                drafter_pb2.DrafterStatusRequest(), timeout=TIMEOUT_S
            )
        return verifier.open_sequences, drafter.open_sequences

    def reclaimed(self) -> tuple[float | None, float | None]:
        """``specdec:sequences_reclaimed_total`` of (verifier, drafter)."""
        name = "specdec:sequences_reclaimed_total"
        return (
            self.verifier.scheduler.metrics.registry.get_sample_value(name),
            self.drafter.scheduler.metrics.registry.get_sample_value(name),
        )


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=5, vocab_size=8, num_layers=1)


@pytest.fixture
def workers(target: LoadedModel) -> Iterator[Workers]:
    """A tiny verifier and an n-gram drafter, both leasing sequences for ``IDLE_S``."""
    verifier = start_verifier(VerifierConfig(sequence_idle_timeout_s=IDLE_S, torch_threads=1), model=target)
    drafter = start_drafter(DrafterConfig(kind="ngram", sequence_idle_timeout_s=IDLE_S), target=target)
    yield Workers(verifier, drafter)
    verifier.stop(0)
    drafter.stop(0)


def test_the_unary_touch_renews_a_lease(workers: Workers) -> None:
    with grpc.insecure_channel(workers.verifier.address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        request = verifier_pb2.OpenVerifyRequest(sequence_id="kept", prompt_ids=[1, 2], max_tokens=4)
        stub.OpenSequence(request, timeout=TIMEOUT_S)
        for _ in range(round(2 * IDLE_S / KEEPALIVE_S)):
            stub.Touch(common_pb2.TouchRequest(sequence_ids=["kept", "unknown"]), timeout=TIMEOUT_S)
            time.sleep(KEEPALIVE_S)
        assert workers.open_sequences() == (1, 0)
    wait_until(lambda: workers.open_sequences() == (0, 0), 2 * IDLE_S)


def test_a_live_router_keeps_its_idle_sequences_and_a_gone_one_loses_them(workers: Workers) -> None:
    """Sequences the router holds open with no call (a client that stopped reading) outlive the lease while the
    router renews it; once it stops, both workers reclaim them and count it."""
    config = RouterConfig(
        model="tiny",
        verifiers=(workers.verifier.address,),
        drafters=(workers.drafter.address,),
        health_interval_s=3600,
        sequence_keepalive_s=KEEPALIVE_S,
    )
    spec = SequenceSpec((1, 2, 3), SamplingParams(0.0), 8, True, False, DraftShape(2))

    async def main() -> None:
        pool = await WorkerPool.start(config)
        try:
            for name in ("a", "b"):
                await pool.verifiers[0].open(name, spec, seed=1)
                await pool.drafters[0].open(name, spec, seed=1)
            await asyncio.sleep(3 * IDLE_S)
            assert workers.open_sequences() == (2, 2) and workers.reclaimed() == (0, 0)
            await pool.stop_health_checks()  # no more renewals: as if the router were gone
            await asyncio.to_thread(wait_until, lambda: workers.open_sequences() == (0, 0), 2 * IDLE_S)
            assert workers.reclaimed() == (2, 2)
        finally:
            await pool.close()

    asyncio.run(main())


def test_sigkill_of_a_router_with_streams_in_flight_frees_every_worker_sequence(workers: Workers) -> None:
    command = [sys.executable, "-m", "router", "--model", "tiny", "--no-tokenizer"]
    command += ["--verifier", workers.verifier.address, "--drafter", workers.drafter.address]
    command += ["--default-drafter", "ngram", "--grpc-port", "0", "--http-port", "0"]
    command += ["--sequence-keepalive-s", str(KEEPALIVE_S)]
    router = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE, text=True)
    streams = []
    try:
        ready = json.loads(router.stdout.readline())
        channel = grpc.insecure_channel(ready["grpc"])
        stub = router_pb2_grpc.RouterStub(channel)
        request = router_pb2.GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=240, ignore_eos=True)
        request.sampling.temperature = 0.0
        streams = [stub.Generate(request, timeout=TIMEOUT_S) for _ in range(6)]
        for stream in streams:
            next(stream)  # every stream is generating: its sequences are open on both workers
        router.send_signal(signal.SIGKILL)
        router.wait(TIMEOUT_S)
        verifier_open, drafter_open = workers.open_sequences()
        assert verifier_open > 0 and drafter_open > 0, "the streams ended before the router was killed"
        waited = wait_until(lambda: workers.open_sequences() == (0, 0), 1.25 * IDLE_S + 2.0)
        assert workers.reclaimed() == (verifier_open, drafter_open), waited
    finally:
        for stream in streams:
            stream.cancel()
        if router.poll() is None:
            router.kill()
        router.communicate(timeout=10)
