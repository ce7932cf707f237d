"""The drafter gRPC service on loopback with tiny models: round trips, exact proposals on the wire, batching of
concurrent Propose calls, pipelined rounds, bad input, overload, health, shutdown and the standalone process."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from specdec_wire.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

from drafter_service import DrafterConfig, RunningDrafter, start_drafter
from drafter_service.scheduler import DraftScheduler
from drafter_service.server import SERVICE_NAME, build_core_drafter
from drafter_service.servicer import shape_from_wire
from grpc_common.convert import sampling_to_wire
from grpc_common.convert_rows import proposal_from_wire
from grpc_common.memory import IdleTrim
from specdec.drafters import DraftConfig, Proposal
from specdec.errors import CancelledByCallerError, InvalidArgumentError
from specdec.models import LoadedModel
from specdec.sampling import SamplingParams, make_generator
from specdec.tree import TokenTree
from tests.test_metrics import DRAFTER_NAMES, scrape
from tests.tiny_models import tiny_draft, tiny_llama

VOCAB = 16
TIMEOUT_S = 20
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=12)
PROMPT = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
TREE_SHAPE = drafter_pb2.DraftShape(
    num_draft_tokens=3, tree_width=2, tree_budget=7, sibling_sampling=common_pb2.SIBLING_SAMPLING_WITHOUT_REPLACEMENT
)
KINDS = ["ngram", "model", "early-exit"]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return tiny_llama(seed=51, vocab_size=VOCAB, num_layers=2)


@pytest.fixture(scope="module")
def draft(target: LoadedModel) -> LoadedModel:
    return tiny_draft(target, seed=52, num_layers=1, noise=0.2)


def config_for(kind: str, **overrides) -> DrafterConfig:
    settings = {"kind": kind, "target": "tiny", "draft_model": "tiny-draft" if kind == "model" else None}
    return DrafterConfig(**{**settings, "early_exit_layers": 1, "draft_top_k": 8, **overrides})


@pytest.fixture
def serve(target: LoadedModel, draft: LoadedModel) -> Iterator[Callable[..., RunningDrafter]]:
    """Start drafters on 127.0.0.1:0 sharing the tiny models; all are stopped after the test."""
    running: list[RunningDrafter] = []

    def start(kind: str, **overrides) -> RunningDrafter:
        server = start_drafter(config_for(kind, **overrides), target=target, draft=draft)
        running.append(server)
        return server

    yield start
    for server in running:
        server.stop(grace_s=0)


def stub_for(server: RunningDrafter) -> drafter_pb2_grpc.DrafterStub:
    return drafter_pb2_grpc.DrafterStub(grpc.insecure_channel(server.address))


def open_request(sequence_id: str, prompt: list[int], params: SamplingParams, seed: int = 0, shape=None):
    return drafter_pb2.OpenDraftRequest(
        sequence_id=sequence_id, prompt_ids=prompt, sampling=sampling_to_wire(params), seed=seed, shape=shape
    )


def status(stub: drafter_pb2_grpc.DrafterStub) -> drafter_pb2.DrafterStatusReply:
    return stub.Status(drafter_pb2.DrafterStatusRequest(), timeout=TIMEOUT_S)


def propose(stub, sequence_id: str, max_tokens: int = 8, assume: bool = False) -> tuple[Proposal, int]:
    reply = stub.Propose(
        drafter_pb2.ProposeRequest(sequence_id=sequence_id, max_tokens=max_tokens, assume_previous_accepted=assume),
        timeout=TIMEOUT_S,
    )
    assert reply.wire_bytes == reply.proposal.ByteSize() and reply.draft_ns > 0
    return proposal_from_wire(reply.proposal, VOCAB), reply.wire_bytes


def commit(stub, sequence_id: str, base_length: int, emitted: list[int]) -> None:
    reply = stub.Commit(
        drafter_pb2.DraftCommitRequest(sequence_id=sequence_id, base_length=base_length, emitted=emitted),
        timeout=TIMEOUT_S,
    )
    assert reply.commit_ns > 0  # the drafter's time applying it, which the router counts as state


def assert_identical(got: Proposal, expected: Proposal) -> None:
    """Same tree, scheme and bit-identical ``q`` rows."""
    assert got.tree == expected.tree and got.scheme == expected.scheme
    assert (got.draft_probs is None) == (expected.draft_probs is None)
    if expected.draft_probs is not None:
        assert torch.equal(got.draft_probs, expected.draft_probs)


# --- round trips ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_open_propose_commit_close_round_trip(kind: str, serve) -> None:
    server = serve(kind)
    stub = stub_for(server)
    reply = stub.OpenSequence(open_request("seq-1", PROMPT, SAMPLED, seed=3), timeout=TIMEOUT_S)
    assert reply.open_ns > 0
    assert (status(stub).open_sequences, status(stub).runner_sequences) == (1, 0 if kind == "ngram" else 1)
    text = list(PROMPT)
    for _ in range(4):
        proposal, wire_bytes = propose(stub, "seq-1")
        assert len(proposal.tree) > 0 and wire_bytes > 0
        emitted = [proposal.tree.tokens[0], 1]  # first node accepted, then a correction (seen before: n-grams match)
        commit(stub, "seq-1", len(text), emitted)
        text += emitted
    reply = stub.Propose(drafter_pb2.ProposeRequest(sequence_id="seq-1", max_tokens=8), timeout=TIMEOUT_S)
    assert reply.model_free == (kind == "ngram")  # a lookup ran no model: its time is no draft level's cost
    stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="seq-1"), timeout=TIMEOUT_S)
    stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="seq-1"), timeout=TIMEOUT_S)  # idempotent
    final = status(stub)
    assert (final.kind, final.open_sequences, final.runner_sequences) == (kind, 0, 0)
    assert final.proposals == 5


@pytest.mark.parametrize("shape", [None, TREE_SHAPE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind", ["model", "early-exit"])
def test_proposals_on_the_wire_equal_the_in_process_drafter_bit_for_bit(kind: str, shape, serve, target, draft) -> None:
    """Pipelined rounds (assume, confirm, roll back) over gRPC; each proposal decodes to exactly what the core
    drafter, driven by the same calls and seed in process, proposes."""
    server = serve(kind)
    stub = stub_for(server)
    local = build_core_drafter(server.config, target=target, draft=draft)
    wire_shape = shape or drafter_pb2.DraftShape()
    stub.OpenSequence(open_request("s", PROMPT, SAMPLED, seed=11, shape=wire_shape), timeout=TIMEOUT_S)
    handle = local.open(PROMPT, SAMPLED, make_generator(11), shape_from_wire(wire_shape, server.config.draft_config()))

    def both(assume: bool = False) -> Proposal:
        got, _ = propose(stub, "s", assume=assume)
        if assume:
            local.assume_accepted(handle)
        [expected] = local.propose([handle], [8])
        assert_identical(got, expected)
        assert got.draft_probs is not None and len(got.tree) > 1
        return got

    def sync(base: int, emitted: list[int]) -> None:
        commit(stub, "s", base, emitted)
        local.sync(handle, base, emitted)

    both()  # round k
    second = both(assume=True)  # round k+1, drafted on top of round k's assumed path
    text = local.text(handle)
    sync(len(PROMPT), text[len(PROMPT) :])  # all of round k accepted, bonus deferred: a confirmation
    sync(len(text), [second.tree.tokens[0], 3])  # round k+1: its first node accepted, then a correction
    both()
    committed = len(local.text(handle))
    both(assume=True)
    sync(committed, [7])  # the assumed round is rejected at its first token: roll back
    assert local.text(handle)[-1] == 7
    both()
    stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="s"), timeout=TIMEOUT_S)
    assert status(stub).runner_sequences == 0


# --- batching -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "early-exit"])
def test_concurrent_proposes_are_batched_and_each_equals_its_own(kind: str, serve, target, draft) -> None:
    """8 client threads, one sequence each, propose and commit in lock step: the server answers several Propose
    calls with one drafter call, and every proposal equals that sequence's proposal drafted alone (greedy)."""
    server = serve(kind, batch_wait_ms=50)
    stub = stub_for(server)
    local = build_core_drafter(server.config, target=target, draft=draft)
    prompts = [[(7 * i + j) % (VOCAB - 1) for j in range(3 + i)] for i in range(8)]
    barrier = threading.Barrier(len(prompts))
    results: dict[int, list[Proposal]] = {}
    errors: list[BaseException] = []

    def client(index: int) -> None:
        try:
            sequence_id = f"seq-{index}"
            stub.OpenSequence(open_request(sequence_id, prompts[index], GREEDY, shape=TREE_SHAPE), timeout=TIMEOUT_S)
            text, got = list(prompts[index]), []
            for _ in range(3):
                barrier.wait(timeout=TIMEOUT_S)
                proposal, _ = propose(stub, sequence_id)
                got.append(proposal)
                emitted = [proposal.tree.tokens[0], index % VOCAB]
                commit(stub, sequence_id, len(text), emitted)
                text += emitted
            results[index] = got
            stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id=sequence_id), timeout=TIMEOUT_S)
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=2 * TIMEOUT_S)
    assert not errors, errors
    final = status(stub)
    assert final.max_batch > 1, "no two Propose calls were ever answered by one drafter call"
    assert final.proposals == 3 * len(prompts) and final.batches < final.proposals
    assert (final.open_sequences, final.runner_sequences) == (0, 0)
    shape = shape_from_wire(TREE_SHAPE, server.config.draft_config())
    for index, prompt in enumerate(prompts):  # the same rounds, one sequence alone
        handle, text = local.open(prompt, GREEDY, make_generator(0), shape), list(prompt)
        for got in results[index]:
            [alone] = local.propose([handle], [8])
            assert_identical(got, alone)
            emitted = [alone.tree.tokens[0], index % VOCAB]
            local.sync(handle, len(text), emitted)
            text += emitted
        local.close(handle)


class ScriptedDrafter:
    """A drafter double for the scheduler: logs every call, fails proposals for chosen handles, and ``open``
    blocks while ``gate`` is clear (so tests can queue jobs behind it)."""

    runner_sequences = 0

    def __init__(self) -> None:
        self.next_handle = itertools.count()
        self.calls: list[tuple[str, list[int]]] = []
        self.handles: dict[int, int] = {}  # handle -> first prompt token
        self.fail_handles: set[int] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.propose_gate = threading.Event()  # propose waits for it, then asks ``stop`` about every handle
        self.propose_gate.set()
        self.stopped: list[int] = []

    @property
    def num_open(self) -> int:
        return len(self.handles)

    def open(self, prompt, params, generator, config=None) -> int:
        self.gate.wait(TIMEOUT_S)
        handle = next(self.next_handle)
        self.calls.append(("open", [handle]))
        self.handles[handle] = prompt[0]
        return handle

    def propose(self, handles: list[int], max_tokens: list[int], stop=None) -> list[Proposal]:
        self.calls.append(("propose", list(handles)))
        self.propose_gate.wait(TIMEOUT_S)
        self.stopped = [handle for handle in handles if stop is not None and stop(handle)]
        if self.fail_handles & set(handles):
            raise RuntimeError("device error")
        return [Proposal(TokenTree.chain([self.handles[handle]]), None) for handle in handles]

    def pre_draft(self, handles: list[int], max_tokens: list[int], stop=None) -> list[list[Proposal]]:
        return [[] for _ in handles]

    def assume_accepted(self, handle: int) -> None:
        self.calls.append(("assume", [handle]))

    def sync(self, handle: int, base_length: int, emitted: list[int]) -> None:
        self.calls.append(("sync", [handle]))

    def close(self, handle: int) -> None:
        self.calls.append(("close", [handle]))
        del self.handles[handle]


@pytest.fixture
def scripted() -> Iterator[tuple[DraftScheduler, ScriptedDrafter]]:
    drafter = ScriptedDrafter()
    scheduler = DraftScheduler(drafter, max_batch_size=3)
    scheduler.start()
    yield scheduler, drafter
    drafter.gate.set()
    scheduler.stop()
    assert drafter.num_open == 0, "stop must close every open sequence"


def open_all(scheduler: DraftScheduler, names: list[str]) -> None:
    for index, name in enumerate(names):
        scheduler.open(name, [index], GREEDY, 0, DraftConfig()).result(TIMEOUT_S)


def hold(scheduler: DraftScheduler, drafter: ScriptedDrafter) -> Future:
    """Occupy the scheduler thread with an open that waits for ``drafter.gate``."""
    drafter.gate.clear()
    future = scheduler.open("holder", [0], GREEDY, 0, DraftConfig())
    while not future.running():
        time.sleep(0.001)
    return future


def test_queued_proposes_become_batches_in_arrival_order_per_sequence(scripted) -> None:
    scheduler, drafter = scripted
    open_all(scheduler, ["a", "b", "c", "d"])
    hold(scheduler, drafter)
    futures = [scheduler.propose(name, 4, False) for name in ["a", "b", "c", "d"]]  # batch cap 3: [a b c] [d]
    futures.append(scheduler.commit("a", 1, [5]))  # a's commit runs after a's first proposal ...
    futures.append(scheduler.propose("a", 4, True))  # ... and before its next one
    del drafter.calls[:]
    drafter.gate.set()
    for future in futures:
        future.result(TIMEOUT_S)
    assert drafter.calls[1:] == [  # after the holder's open
        ("propose", [0, 1, 2]),
        ("sync", [0]),  # no pending batch holds "a": runs at once
        ("assume", [0]),
        ("propose", [3, 0]),
    ]
    snapshot = scheduler.status().result(TIMEOUT_S)
    assert (snapshot.proposals, snapshot.batches, snapshot.max_batch, snapshot.open_sequences) == (5, 2, 3, 5)


def test_a_propose_reports_how_long_it_waited_for_its_batch(scripted) -> None:
    """``queued_ns``: from the call to the start of the batch that drafted it (here: behind a held job)."""
    scheduler, drafter = scripted
    open_all(scheduler, ["a"])
    hold(scheduler, drafter)
    waited = scheduler.propose("a", 4, False)
    time.sleep(0.05)
    drafter.gate.set()
    assert waited.result(TIMEOUT_S).queued_ns >= 45e6
    assert scheduler.propose("a", 4, False).result(TIMEOUT_S).queued_ns < 45e6  # nothing ahead of it


def test_a_job_for_a_sequence_in_the_pending_batch_flushes_it_first(scripted) -> None:
    scheduler, drafter = scripted
    open_all(scheduler, ["a", "b"])
    hold(scheduler, drafter)
    futures = [scheduler.propose("a", 4, False), scheduler.propose("b", 4, False), scheduler.commit("b", 1, [5])]
    futures += [scheduler.propose("b", 4, True), scheduler.propose("a", 4, False)]
    del drafter.calls[:]
    drafter.gate.set()
    for future in futures:
        future.result(TIMEOUT_S)
    assert drafter.calls[1:] == [
        ("propose", [0, 1]),  # flushed: b's commit must follow b's proposal
        ("sync", [1]),
        ("assume", [1]),
        ("propose", [1, 0]),
    ]


def test_a_failing_batch_is_retried_one_sequence_at_a_time(scripted) -> None:
    scheduler, drafter = scripted
    open_all(scheduler, ["a", "b", "c"])
    drafter.fail_handles = {1}
    hold(scheduler, drafter)
    futures = {name: scheduler.propose(name, 4, False) for name in ["a", "b", "c"]}
    drafter.gate.set()
    assert futures["a"].result(TIMEOUT_S)[0].tree.tokens == (0,)
    assert futures["c"].result(TIMEOUT_S)[0].tree.tokens == (2,)
    with pytest.raises(RuntimeError, match="device error"):
        futures["b"].result(TIMEOUT_S)
    assert [call for call in drafter.calls if call[0] == "propose"] == [
        ("propose", [0, 1, 2]),
        ("propose", [0]),
        ("propose", [1]),
        ("propose", [2]),
    ]


def test_a_job_cancelled_before_it_runs_has_no_effect(scripted) -> None:
    scheduler, drafter = scripted
    hold(scheduler, drafter)
    opened = scheduler.open("late", [3], GREEDY, 0, DraftConfig())
    assert opened.cancel()  # the caller went away (deadline, cancel) while the job was queued
    drafter.gate.set()
    assert scheduler.status().result(TIMEOUT_S).open_sequences == 1  # the holder only
    scheduler.open("late", [3], GREEDY, 0, DraftConfig()).result(TIMEOUT_S)  # the id is free


# --- bad input, overload, health, shutdown ----------------------------------------------------------------------


def expect_error(call: Callable[[], object], code: grpc.StatusCode, field: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == code, raised.value.details()
    assert field in raised.value.details()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_names_the_field_and_the_server_stays_up(kind: str, serve) -> None:
    server = serve(kind)
    stub = stub_for(server)
    bad = grpc.StatusCode.INVALID_ARGUMENT

    def sampling(**fields) -> drafter_pb2.OpenDraftRequest:
        return drafter_pb2.OpenDraftRequest(
            sequence_id="x", prompt_ids=[1], sampling=common_pb2.SamplingParams(**fields)
        )

    opens = [
        ("prompt", open_request("x", [], GREEDY)),
        ("prompt", open_request("x", [1, VOCAB], GREEDY)),
        ("sequence_id", open_request("", [1], GREEDY)),
        ("num_draft_tokens", open_request("x", [1], GREEDY, shape=drafter_pb2.DraftShape(num_draft_tokens=-1))),
        ("tree_width", open_request("x", [1], GREEDY, shape=drafter_pb2.DraftShape(tree_width=-2))),
        ("top_p", sampling(top_p=0)),
        ("temperature", sampling(temperature=-1)),
    ]
    for field, request in opens:
        expect_error(lambda request=request: stub.OpenSequence(request, timeout=TIMEOUT_S), bad, field)
    assert status(stub).open_sequences == 0
    stub.OpenSequence(open_request("x", PROMPT, GREEDY), timeout=TIMEOUT_S)
    expect_error(lambda: stub.OpenSequence(open_request("x", PROMPT, GREEDY), timeout=TIMEOUT_S), bad, "sequence_id")
    not_found = grpc.StatusCode.NOT_FOUND
    expect_error(lambda: propose(stub, "nobody"), not_found, "sequence_id")
    expect_error(lambda: commit(stub, "nobody", 1, [1]), not_found, "sequence_id")
    expect_error(lambda: propose(stub, "x", max_tokens=-1), bad, "max_tokens")
    expect_error(lambda: propose(stub, "x", assume=True), bad, "assume_previous_accepted")  # nothing proposed yet
    expect_error(lambda: commit(stub, "x", len(PROMPT) + 1, [1]), bad, "base_length")
    expect_error(lambda: commit(stub, "x", len(PROMPT), [VOCAB]), bad, "emitted")
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    for service in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    proposal, _ = propose(stub, "x")  # still serving, the sequence untouched
    assert proposal.tree.is_chain
    stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="x"), timeout=TIMEOUT_S)
    assert (status(stub).open_sequences, status(stub).runner_sequences) == (0, 0)


def test_too_many_open_sequences_is_resource_exhausted(serve) -> None:
    stub = stub_for(serve("early-exit", max_open_sequences=2))
    for name in ("a", "b"):
        stub.OpenSequence(open_request(name, PROMPT, GREEDY), timeout=TIMEOUT_S)
    expect_error(
        lambda: stub.OpenSequence(open_request("c", PROMPT, GREEDY), timeout=TIMEOUT_S),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "retry",
    )
    assert status(stub).runner_sequences == 2  # the refused open holds nothing
    stub.CloseSequence(drafter_pb2.CloseDraftRequest(sequence_id="a"), timeout=TIMEOUT_S)
    stub.OpenSequence(open_request("c", PROMPT, GREEDY), timeout=TIMEOUT_S)


def test_stop_frees_every_sequence_and_the_port(target, draft) -> None:
    server = start_drafter(config_for("model"), target=target, draft=draft)
    stub = stub_for(server)
    for name in ("a", "b", "c"):
        stub.OpenSequence(open_request(name, PROMPT, SAMPLED), timeout=TIMEOUT_S)
    propose(stub, "a")
    drafter = server.scheduler.drafter
    server.stop(grace_s=0.5)
    assert drafter.num_open == drafter.runner_sequences == 0
    with pytest.raises(grpc.RpcError) as raised:
        status(stub)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_config_from_flags_over_environment() -> None:
    config = DrafterConfig.from_args(
        ["--kind", "early-exit", "--early-exit-layers", "3", "--port", "0"],
        {"SPECDEC_DRAFTER_TARGET": "some/dir", "SPECDEC_DRAFTER_PORT": "7000", "SPECDEC_DRAFTER_DRAFT_TOP_K": "5"},
    )
    assert (config.kind, config.target, config.early_exit_layers, config.port, config.draft_top_k) == (
        "early-exit",
        "some/dir",
        3,
        0,
        5,
    )
    assert DrafterConfig.from_args([], {"SPECDEC_DRAFTER_KIND": "ngram"}).kind == "ngram"
    eagle = DrafterConfig.from_args(["--kind", "eagle"], {"SPECDEC_DRAFTER_DRAFT_QUANTIZATION": "int8"})
    assert eagle.draft_quantization == "int8"
    for kwargs, field in [
        ({"kind": "none"}, "kind"),
        ({"kind": "model"}, "draft_model"),
        ({"kind": "ngram", "num_draft_tokens": 0}, "num_draft_tokens"),
        ({"kind": "ngram", "max_batch_size": 0}, "max_batch_size"),
        ({"kind": "ngram", "dtype": "int8"}, "dtype"),
        ({"kind": "ngram", "draft_quantization": "int8"}, "draft_quantization"),
        ({"kind": "eagle", "draft_quantization": "int4"}, "draft_quantization"),
    ]:
        with pytest.raises(ValueError, match=field):
            DrafterConfig(**kwargs)


@pytest.mark.slow
def test_standalone_process_serves_and_stops_on_sigterm(tmp_path: Path, target) -> None:
    """``python -m drafter_service`` on a tiny checkpoint directory: one JSON line (with the metrics address),
    serving gRPC and ``/metrics``, clean SIGTERM exit."""
    target.model.save_pretrained(tmp_path / "tiny")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "SPECDEC_DRAFTER_TORCH_THREADS": "1"}
    command = [sys.executable, "-m", "drafter_service", "--kind", "early-exit", "--target", str(tmp_path / "tiny")]
    process = subprocess.Popen(
        [*command, "--early-exit-layers", "1", "--grace-s", "1", "--metrics-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read()
        ready = json.loads(line)
        assert ready["kind"] == "early-exit"
        _, names = scrape(ready["metrics"])
        assert not DRAFTER_NAMES - names
        channel = grpc.insecure_channel(ready["address"])
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = drafter_pb2_grpc.DrafterStub(channel)
        stub.OpenSequence(open_request("s", PROMPT, SAMPLED, seed=1), timeout=TIMEOUT_S)
        proposal, _ = propose(stub, "s")
        assert len(proposal.tree) == 4 and proposal.draft_probs is not None
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_commit_cancels_the_predrafts_it_names_queued_running_or_late(scripted) -> None:
    """``cancel_through`` acts at once: a queued pre-draft never runs, a running one is asked to stop (and answers
    CANCELLED), one arriving after the Commit is refused; later pre-drafts and fresh proposals run."""
    scheduler, drafter = scripted
    open_all(scheduler, ["a"])
    hold(scheduler, drafter)
    queued = scheduler.propose("a", 4, True, propose_id=1)
    commit = scheduler.commit("a", 1, [5], cancel_through=1)
    drafter.gate.set()
    with pytest.raises(CancelledByCallerError):
        queued.result(TIMEOUT_S)
    commit.result(TIMEOUT_S)
    with pytest.raises(CancelledByCallerError):
        scheduler.propose("a", 4, True, propose_id=1).result(TIMEOUT_S)  # late: refused without running
    assert ("assume", [0]) not in drafter.calls and ("propose", [0]) not in drafter.calls
    scheduler.propose("a", 4, False).result(TIMEOUT_S)
    drafter.propose_gate.clear()
    calls = len(drafter.calls)
    running = scheduler.propose("a", 4, True, propose_id=2)
    while ("propose", [0]) not in drafter.calls[calls:]:
        time.sleep(0.001)
    scheduler.commit("a", 1, [6], cancel_through=2)  # while the drafter is mid-draft
    drafter.propose_gate.set()
    with pytest.raises(CancelledByCallerError):
        running.result(TIMEOUT_S)
    assert drafter.stopped == [0], "the running draft was told to stop"
    drafted = scheduler.propose("a", 4, True, propose_id=3).result(TIMEOUT_S)
    assert len(drafted.proposal.tree) == 1 and drafted.outcome_proposals == []
    assert scheduler.status().result(TIMEOUT_S).cancelled == 3


def test_a_sequence_opened_again_under_its_id_inherits_no_cancellation() -> None:
    """A sequence's cancelled propose ids go with it however it ends (closed, its lease reclaimed, or a Commit that
    came after it closed): opened again under the same id, its Proposes run. Before, a reclaimed sequence's ids
    stayed cancelled (and were never freed)."""
    drafter = ScriptedDrafter()
    scheduler = DraftScheduler(drafter, max_batch_size=3, idle_timeout_s=0.5)
    scheduler.start()
    try:
        for ending in ("reclaimed", "closed", "committed after close"):
            open_all(scheduler, ["a"])
            scheduler.commit("a", 1, [5], cancel_through=5).result(TIMEOUT_S)
            if ending != "reclaimed":
                scheduler.close("a").result(TIMEOUT_S)
            if ending == "committed after close":
                with pytest.raises(KeyError):
                    scheduler.commit("a", 1, [5], cancel_through=9).result(TIMEOUT_S)
            deadline = time.monotonic() + TIMEOUT_S
            while drafter.num_open and time.monotonic() < deadline:  # the lease runs out
                time.sleep(0.01)
            assert drafter.num_open == 0, ending
            open_all(scheduler, ["a"])
            drafted = scheduler.propose("a", 4, False, propose_id=3).result(TIMEOUT_S)
            assert len(drafted.proposal.tree) >= 1, ending
            scheduler.close("a").result(TIMEOUT_S)
    finally:
        scheduler.stop()


@pytest.mark.parametrize(("kind", "quantization"), [("ngram", "auto"), ("eagle", "none"), ("eagle", "auto")])
def test_a_drafter_that_runs_no_target_weights_never_loads_them(
    kind: str, quantization: str, target: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ngram and eagle drafters read the target's config (its sizes) only: a drafter machine serving them for a
    70B target must not hold its weights. Loading any model's weights fails here; the drafter still drafts (an
    eagle head by default, ``--draft-quantization auto``, over int8 weights on this CPU)."""
    from specdec.drafters import EagleDrafter, NgramDrafter
    from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head
    from specdec.linear import Int8Linear

    target.model.save_pretrained(tmp_path / "target")
    head = EagleHead.from_target(target.model, torch.arange(VOCAB))
    save_head(head, tmp_path / "head", HeadInfo(verifier=str(tmp_path / "target"), num_draft_tokens=3))

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr("specdec.models.AutoModelForCausalLM.from_pretrained", no_weights)
    config = DrafterConfig(
        kind=kind,
        target=str(tmp_path / "target"),
        draft_model=str(tmp_path / "head") if kind == "eagle" else None,
        draft_quantization=quantization,
    )
    drafter = build_core_drafter(config)
    assert isinstance(drafter, EagleDrafter if kind == "eagle" else NgramDrafter)
    handle = drafter.open(PROMPT, GREEDY, make_generator(0))
    if kind == "eagle":
        assert drafter.feature_width == 32
        assert isinstance(drafter.head.lm_head, Int8Linear) == (quantization == "auto")  # the default
        drafter.add_features(handle, 0, torch.randn(len(PROMPT) - 1, 32))
    [proposal] = drafter.propose([handle], [3])
    assert len(proposal.tree) == 3


@pytest.mark.parametrize("kind", ["early-exit", "eagle"])
def test_a_device_the_machine_lacks_is_refused_naming_it(kind: str, target: LoadedModel, tmp_path: Path) -> None:
    """A drafter placed on a CUDA device this machine does not have fails with an error naming ``device`` (the
    service prints it as one line), whether it loads the target's weights or only an EAGLE head."""
    from specdec.drafters.eagle_head import EagleHead, HeadInfo, save_head

    target.model.save_pretrained(tmp_path / "target")
    head = EagleHead.from_target(target.model, torch.arange(VOCAB))
    save_head(head, tmp_path / "head", HeadInfo(verifier=str(tmp_path / "target"), num_draft_tokens=3))
    config = DrafterConfig(
        kind=kind,
        target=str(tmp_path / "target"),
        draft_model=str(tmp_path / "head") if kind == "eagle" else None,
        device="cuda:99",
    )
    with pytest.raises(InvalidArgumentError, match="device"):
        build_core_drafter(config)


def test_idle_trim_runs_once_the_drafter_goes_idle() -> None:
    trimmed = threading.Event()
    drafter = ScriptedDrafter()
    scheduler = DraftScheduler(drafter, max_batch_size=3, idle_trim=IdleTrim(0.01, trimmed.set))
    scheduler.start()
    try:
        open_all(scheduler, ["a"])
        assert trimmed.wait(TIMEOUT_S), "no job for idle_s after work: trim"
        open_all(scheduler, ["b"])  # it serves on after a trim
        assert drafter.num_open == 2
    finally:
        scheduler.stop()


def test_a_drafter_trims_freed_memory_after_a_second_idle_by_default() -> None:
    assert DrafterConfig(kind="ngram").malloc_trim_idle_s == 1.0
    assert DrafterConfig.from_args(["--kind", "ngram", "--malloc-trim-idle-s", "0"]).malloc_trim_idle_s == 0
    with pytest.raises(ValueError, match="malloc_trim_idle_s"):
        DrafterConfig(kind="ngram", malloc_trim_idle_s=-1)
