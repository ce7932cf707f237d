"""``python -m verifier_service``: serve a target model until SIGTERM / SIGINT.

Prints one JSON line, ``{"address": "HOST:PORT", "model": NAME, "world_size": N}`` (plus ``"metrics":
"HOST:PORT"`` with ``--metrics-port``), on stdout once it serves (rank 0 only); logs go to stderr. Exit status 0
after a graceful stop, 2 when the configuration or the model is bad. Tensor parallel: ``torchrun
--nproc-per-node N -m verifier_service --model DIR`` (see :mod:`verifier_service.tensor_parallel`); the other
ranks ignore SIGTERM / SIGINT and stop with rank 0.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from collections.abc import Sequence

import torch.distributed as dist

from grpc_common.process import prepare
from grpc_common.server import TerminationSignal
from specdec import gc_policy
from specdec.errors import SpecdecError
from specdec.runner import KVRunner
from verifier_service.config import VerifierConfig
from verifier_service.server import RunningVerifier, serve, start_verifier_process
from verifier_service.tensor_parallel import (
    SOURCE,
    BroadcastRunner,
    follow,
    init_process_group,
    load_sharded_model,
    stop_followers,
)

LOG = logging.getLogger("verifier_service")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the verifier process (one rank of it under tensor parallelism); returns its exit status."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = VerifierConfig.from_args(argv)
        if config.world_size > 1:
            prepare(torch_threads=config.torch_threads, mmap_threshold_mb=config.malloc_mmap_threshold_mb)
            return _tensor_parallel(config)
        running = start_verifier_process(config)
    except SpecdecError as error:
        print(f"verifier_service: {error}", file=sys.stderr)
        return 2
    _serve_until_signal(running, config)
    return 0


def _tensor_parallel(config: VerifierConfig) -> int:
    """One rank: load the shard; rank 0 serves and drives the others, which follow until it stops."""
    init_process_group(config)
    try:
        if config.rank != SOURCE:
            for signum in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when everyone stops
                signal.signal(signum, signal.SIG_IGN)
            model = load_sharded_model(config)
            follow(KVRunner(model.model, max_seq_len=config.max_seq_len or None))
            return 0
        try:
            model = load_sharded_model(config)
            runner = BroadcastRunner(KVRunner(model.model, max_seq_len=config.max_seq_len or None))
            running = serve(config, runner, model)
            gc_policy.settle(thresholds=None)  # as start_verifier_process does
            _serve_until_signal(running, config)
        finally:
            stop_followers()
        return 0
    finally:
        dist.destroy_process_group()


def _serve_until_signal(running: RunningVerifier, config: VerifierConfig) -> None:
    termination = TerminationSignal()
    ready = {"address": running.address, "model": config.model, "world_size": config.world_size}
    if running.metrics_address is not None:
        ready["metrics"] = running.metrics_address
    print(json.dumps(ready), flush=True)
    termination.wait()
    LOG.info("stopping (grace %.1fs)", config.grace_s)
    running.stop()


if __name__ == "__main__":
    sys.exit(main())
