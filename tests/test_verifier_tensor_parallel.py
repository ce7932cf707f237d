"""The tensor-parallel verifier: two CPU ranks (gloo), the tiny target sharded with ``tp_plan="auto"``, rank 0
serving gRPC. Verdicts over the wire equal a single-process BatchVerifier's on the unsharded model, concurrent
calls share forwards across ranks, state is freed, and SIGTERM to rank 0 stops both ranks cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from specdec_wire.v1 import verifier_pb2, verifier_pb2_grpc

from specdec.drafters.base import Proposal
from specdec.runner import KVRunner
from specdec.sampling import SamplingParams
from specdec.tree import TokenTree
from specdec.verification import BatchVerifier, VerifyCall
from tests.test_verifier_service import TIMEOUT_S, open_request, status, verify
from tests.tiny_models import tiny_llama

pytestmark = pytest.mark.slow  # two processes load torch and transformers

WORLD_SIZE = 2
PARAMS = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(temperature=0.9, top_k=6)}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def script(index: int) -> list[Proposal]:
    """Seeded chains and trees with q rows (one per node, small support), some rounds empty."""
    generator = torch.Generator().manual_seed(index)
    proposals = []
    for round_index in range(8):
        size = (index + round_index) % 4
        q = torch.softmax(2 * torch.randn(8, generator=generator), dim=0)
        tokens = torch.multinomial(q, size, replacement=True, generator=generator).tolist() if size else []
        parents = tuple(-1 if node == 0 or (round_index % 3 == 0 and node == 1) else node - 1 for node in range(size))
        proposals.append(Proposal(TokenTree(tuple(tokens), parents), q.expand(size, -1).clone() if size else None))
    return proposals


def run_script(stub, name: str, index: int, params: SamplingParams) -> tuple[list[tuple], int]:
    """The verdicts of ``script(index)`` over the wire, and the largest batch its calls were part of."""
    stub.OpenSequence(open_request(name, [1 + index % 7, 2, 3], params, seed=index, max_tokens=20), timeout=TIMEOUT_S)
    verdicts, largest = [], 0
    for proposal in script(index):
        reply = verify(stub, name, proposal, defer_bonus=index % 2 == 0)
        verdict, largest = reply.verdict, max(largest, reply.batch_size)
        verdicts.append((list(verdict.emitted), list(verdict.accepted_path), verdict.bonus_deferred))
        if verdict.finished:
            break
    stub.CloseSequence(verifier_pb2.CloseVerifyRequest(sequence_id=name), timeout=TIMEOUT_S)
    return verdicts, largest


def run_local(target, index: int, params: SamplingParams) -> list[tuple]:
    verifier = BatchVerifier(KVRunner(target.model))
    verifier.open("x", [1 + index % 7, 2, 3], params, index, 20, target.eos_token_ids, ignore_eos=True)
    verdicts = []
    for proposal in script(index):
        [outcome] = verifier.verify([VerifyCall("x", proposal, defer_bonus=index % 2 == 0)])
        verdict = outcome.verdict
        verdicts.append((verdict.emitted, verdict.accepted_path, outcome.bonus_deferred))
        if verdict.finished:
            break
    return verdicts


def test_two_ranks_serve_the_same_verdicts(tmp_path: Path) -> None:
    target = tiny_llama(seed=21, vocab_size=8, num_layers=2)  # 4 query heads over 2 KV heads: splits in two
    target.model.save_pretrained(tmp_path)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env.update({"WORLD_SIZE": str(WORLD_SIZE), "HF_HUB_OFFLINE": "1"})
    command = [sys.executable, "-m", "verifier_service", "--model", str(tmp_path), "--max-batch-size", "8"]
    root = Path(__file__).resolve().parent.parent
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank)},
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    try:
        first = json.loads(ranks[0].stdout.readline())
        assert first["world_size"] == WORLD_SIZE
        with grpc.insecure_channel(first["address"]) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            results: dict[tuple[str, int], tuple[list[tuple], int]] = {}

            def worker(kind: str, index: int) -> None:
                results[kind, index] = run_script(stub, f"{kind}{index}", index, PARAMS[kind])

            threads = [threading.Thread(target=worker, args=(kind, i)) for kind in PARAMS for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT_S)
            reply = status(stub)
            assert (reply.world_size, reply.open_sequences, reply.runner_sequences) == (WORLD_SIZE, 0, 0)
        assert len(results) == 2 * 4
        for (kind, index), (verdicts, _) in sorted(results.items()):
            assert verdicts == run_local(target, index, PARAMS[kind]), (kind, index)
        assert any(verdict[2] for verdicts, _ in results.values() for verdict in verdicts), "no bonus was deferred"
        assert max(largest for _, largest in results.values()) > 1, "no two calls shared a forward"
        ranks[0].send_signal(signal.SIGTERM)
        assert [rank.wait(timeout=TIMEOUT_S) for rank in ranks] == [0] * WORLD_SIZE
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
