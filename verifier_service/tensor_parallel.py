"""Tensor-parallel verifier: one target sharded over N ranks (``torch.distributed``), rank 0 serving gRPC.

Every rank loads the model with transformers' ``tp_plan="auto"`` (attention heads and MLP columns split, the
row-parallel projections and the embedding all-reduced, the logits gathered) and runs its own
:class:`~specdec.runner.KVRunner`, which holds the KV of its local heads. Only rank 0 serves: it runs the
scheduler, the :class:`~specdec.verification.BatchVerifier` and the acceptance rule. Its runner is wrapped in
:class:`BroadcastRunner`, which replays every state change on the other ranks:

* ``open`` / ``close`` / ``commit`` / ``truncate`` run no collective, so they are applied on rank 0 at once and
  queued; the queue travels with the next ``forward`` (one broadcast per batch);
* ``forward`` is broadcast, then run on every rank together (its collectives pair up across ranks).

The followers (:func:`follow`) apply the ops in order and drop their logits. Every rank thus holds the same
sequences, lengths and scratch, so the runner ids and any validation error agree across ranks. Launch with
``torchrun --nproc-per-node N -m verifier_service ...`` (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``); the backend is gloo on CPU and NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

from specdec.errors import InvalidArgumentError, ModelNotFoundError, SpecdecError
from specdec.model_files import MODEL_ALIASES
from specdec.models import LoadedModel, eos_token_ids
from specdec.runner import ForwardItem, KVRunner
from verifier_service.config import VerifierConfig

LOG = logging.getLogger(__name__)

SOURCE = 0
# An idle verifier leaves its followers waiting in a broadcast: the collective timeout bounds idleness, not work.
IDLE_TIMEOUT = datetime.timedelta(days=7)

Op = tuple[str, tuple[Any, ...]]


def init_process_group(config: VerifierConfig) -> None:
    """Join the ``config.world_size`` ranks (rendezvous from ``MASTER_ADDR`` / ``MASTER_PORT``)."""
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=config.rank, world_size=config.world_size, timeout=IDLE_TIMEOUT)


def load_sharded_model(config: VerifierConfig) -> LoadedModel:
    """``config.model`` (a local directory or hub id) sharded over the process group with ``tp_plan="auto"``.

    GGUF aliases are refused: tensor parallelism loads safetensors shards per rank.
    """
    if config.model in MODEL_ALIASES or config.model.endswith(".gguf"):
        raise InvalidArgumentError("model", "tensor parallelism needs a model directory or hub id, not a GGUF file")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=getattr(torch, config.dtype), distributed_config=DistributedConfig(tp_plan="auto")
        )
    except (OSError, ValueError) as error:
        raise ModelNotFoundError(f"model {config.model!r}: cannot load it tensor-parallel: {error}") from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model)
    except (OSError, ValueError):
        tokenizer = None
    model = model.eval().requires_grad_(False)
    return LoadedModel(model, tokenizer, config.model, int(model.config.vocab_size), eos_token_ids(model, tokenizer))


class BroadcastRunner:
    """Rank 0's runner: the local :class:`KVRunner`, with every state change replayed on the other ranks."""

    def __init__(self, runner: KVRunner) -> None:
        self.runner = runner
        self._queued: list[Op] = []

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.runner.max_seq_len

    @property
    def hidden_size(self) -> int:
        return self.runner.hidden_size

    @property
    def num_layers(self) -> int:
        return self.runner.num_layers

    @property
    def num_open(self) -> int:
        return self.runner.num_open

    @property
    def kv_bytes(self) -> int:
        return self.runner.kv_bytes  # this rank's shard; every rank holds the same

    def length(self, seq: int) -> int:
        return self.runner.length(seq)

    def open(self) -> int:
        seq = self.runner.open()
        self._queued.append(("open", (seq,)))
        return seq

    def close(self, seq: int) -> None:
        self.runner.close(seq)
        self._queued.append(("close", (seq,)))

    def commit(self, seq: int, num_pending: int, path: Sequence[int] = ()) -> None:
        self.runner.commit(seq, num_pending, path)
        self._queued.append(("commit", (seq, num_pending, list(path))))

    def truncate(self, seq: int, new_length: int) -> None:
        self.runner.truncate(seq, new_length)
        self._queued.append(("truncate", (seq, new_length)))

    def forward(self, items: Sequence[ForwardItem], *, all_logits: bool = False) -> list[torch.Tensor]:
        """Broadcast the queued ops and this forward, then run it here with the other ranks."""
        self._send(("forward", (list(items), all_logits)))
        return self.runner.forward(items, all_logits=all_logits)

    def forward_features(
        self, items: Sequence[ForwardItem], layers: Sequence[int] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """:meth:`forward` with features; the other ranks run a plain forward (the same collectives: the hidden
        state is replicated after each layer, and the norms that make features have none)."""
        self._send(("forward", (list(items), False)))
        return self.runner.forward_features(items, layers)

    def _send(self, op: Op) -> None:
        message = [[*self._queued, op]]
        self._queued = []
        dist.broadcast_object_list(message, src=SOURCE)


def stop_followers() -> None:
    """From rank 0: every follower returns from :func:`follow` (ops still queued on rank 0 no longer matter)."""
    dist.broadcast_object_list([[("stop", ())]], src=SOURCE)


def follow(runner: KVRunner) -> None:
    """Apply rank 0's ops to this rank's ``runner`` until ``stop``.

    An op that fails here failed the same way on rank 0 (same state, same checks, before any collective).
    """
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=SOURCE)
        for name, args in message[0]:
            if name == "stop":
                return
            try:
                _apply(runner, name, args)
            except SpecdecError as error:
                LOG.debug("replayed op %s failed as on rank 0: %s", name, error)


def _apply(runner: KVRunner, name: str, args: tuple[Any, ...]) -> None:
    if name == "open":
        seq = runner.open()
        if seq != args[0]:
            raise RuntimeError(f"rank state diverged: opened {seq}, rank 0 opened {args[0]}")
    elif name == "forward":
        items, all_logits = args
        runner.forward(items, all_logits=all_logits)
    else:
        getattr(runner, name)(*args)
