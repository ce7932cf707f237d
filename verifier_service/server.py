"""Verifier process wiring: target model → KVRunner → BatchVerifier → scheduler thread → gRPC server with health.

With ``metrics_port`` set, the scheduler's series are also served over HTTP for Prometheus.
"""

from __future__ import annotations

import logging

import torch
from specdec_wire.v1 import verifier_pb2, verifier_pb2_grpc

from grpc_common.memory import IdleTrim, glibc_malloc_trim
from grpc_common.process import start_serving_process
from grpc_common.server import RunningService, start_service
from specdec.acceptance import SampledRule, verify_batched
from specdec.calibration import measure_forward_costs
from specdec.models import LoadedModel, load_model
from specdec.runner import KVRunner
from specdec.verification import BatchVerifier, Runner
from verifier_service.config import VerifierConfig
from verifier_service.metrics import VerifierMetrics
from verifier_service.scheduler import VerifyScheduler
from verifier_service.servicer import VerifierServicer

LOG = logging.getLogger(__name__)

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name  # "specdec.v1.Verifier"


RunningVerifier = RunningService[VerifyScheduler, VerifierConfig]


def start_verifier_process(config: VerifierConfig) -> RunningVerifier:
    """:func:`start_verifier` within this process's settings from ``config`` (threads, mmap threshold, collector;
    :mod:`grpc_common.process`): what ``python -m verifier_service`` and the Ray actor run."""
    return start_serving_process(
        lambda: start_verifier(config),
        torch_threads=config.torch_threads,
        mmap_threshold_mb=config.malloc_mmap_threshold_mb,
        gc_thresholds=None,  # CPython's: the verifier's loop allocates little (specdec.gc_policy)
    )


def start_verifier(
    config: VerifierConfig, *, model: LoadedModel | None = None, acceptance_rule: SampledRule = verify_batched
) -> RunningVerifier:
    """Build the batch verifier on one process, start its scheduler thread and serve it on ``config.host:config.port``.

    ``model`` lets tests and co-located deployments share a target already in memory; otherwise
    ``config.model`` is loaded in ``config.dtype`` on ``config.device``. ``acceptance_rule`` is for tests only
    (a verifier with a deliberately wrong rule, which ``specdec check`` must catch).
    """
    if model is None:
        model = load_model(config.model, dtype=getattr(torch, config.dtype), device=config.device)
    runner = KVRunner(model.model, max_seq_len=config.max_seq_len or None)
    return serve(config, runner, model, acceptance_rule=acceptance_rule)


def serve(
    config: VerifierConfig, runner: Runner, model: LoadedModel, *, acceptance_rule: SampledRule = verify_batched
) -> RunningVerifier:
    """Serve ``runner`` (a :class:`KVRunner` over ``model``, or rank 0's broadcasting one under tensor parallelism)."""
    forward_costs = measure_forward_costs(runner, min(config.calibrate_positions, config.max_batch_tokens))
    verifier = BatchVerifier(runner, max_sequences=config.max_sequences, rule=acceptance_rule)
    metrics = VerifierMetrics(model.name)
    scheduler = VerifyScheduler(
        verifier,
        max_batch_size=config.max_batch_size,
        max_batch_tokens=config.max_batch_tokens,
        max_prefill_backlog_s=config.max_prefill_backlog_s or None,
        forward_costs=forward_costs,
        max_queued=config.max_sequences,
        batch_wait_s=config.batch_wait_ms / 1000,
        arrival_wait=config.arrival_wait,
        metrics=metrics,
        idle_trim=IdleTrim(config.malloc_trim_idle_s, glibc_malloc_trim()),
        idle_timeout_s=config.sequence_idle_timeout_s or None,
    )
    scheduler.start()
    servicer = VerifierServicer(
        scheduler,
        model_name=model.name,
        eos_token_ids=model.eos_token_ids,
        world_size=config.world_size,
        max_proposal_nodes=config.max_proposal_nodes,
        max_batch_calls=config.max_batch_calls,
        max_batch_nodes=config.max_batch_nodes,
        max_message_bytes=config.max_message_bytes,
        forward_costs=forward_costs,
    )
    running = start_service(
        scheduler,
        config,
        lambda grpc_server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, grpc_server),
        [SERVICE_NAME],
        metrics=metrics.registry,
        max_workers=config.handler_threads,
        max_message_bytes=config.max_message_bytes,
    )
    LOG.info("verifier for %s (%d ranks) serving on %s", model.name, config.world_size, running.address)
    return running
