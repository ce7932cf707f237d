"""Drafter process wiring: models → core drafter → scheduler thread → gRPC server with health.

With ``metrics_port`` set, the scheduler's series are also served over HTTP for Prometheus.
"""

from __future__ import annotations

import logging

import torch
from specdec_wire.v1 import drafter_pb2, drafter_pb2_grpc

from drafter_service.config import DrafterConfig
from drafter_service.metrics import DrafterMetrics
from drafter_service.scheduler import DraftScheduler
from drafter_service.servicer import DrafterServicer
from grpc_common.memory import IdleTrim, glibc_malloc_trim
from grpc_common.process import start_serving_process
from grpc_common.server import RunningService, start_service
from specdec.drafters import SHAPE_ONLY_KINDS, Drafter, build_drafter, build_shape_drafter, default_early_exit_layers
from specdec.drafters.eagle_head import HEAD_CONTEXT
from specdec.models import LoadedModel, load_model, load_shape

LOG = logging.getLogger(__name__)

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # "specdec.v1.Drafter"


RunningDrafter = RunningService[DraftScheduler, DrafterConfig]


def build_core_drafter(
    config: DrafterConfig, *, target: LoadedModel | None = None, draft: LoadedModel | None = None
) -> Drafter:
    """The core drafter ``config`` describes, from ``target`` / ``draft`` when given, else loaded by name.

    An ngram or eagle drafter reads only the target's config (its sizes), never its weights. An early-exit drafter
    that loaded the target itself keeps only the layers it runs (plus embeddings, final norm and head); a target
    passed in is shared, never modified. An eagle drafter loads its head from the directory ``config.draft_model``
    (None: the head cached for the target).
    """
    dtype = getattr(torch, config.dtype)
    context = config.eagle_context or HEAD_CONTEXT
    if target is None and config.kind in SHAPE_ONLY_KINDS:  # the target's sizes, never its weights
        shape = load_shape(config.target)
        drafter = build_shape_drafter(
            config.kind,
            shape,
            config.draft_config(),
            draft_model=config.draft_model,
            dtype=dtype,
            device=config.device,
            eagle_context=context,
            quantization=config.draft_quantization,
            lookup_min_match=config.lookup_min_match,
        )
        assert drafter is not None, "a drafter service has a kind"
        return drafter
    owned = target is None
    if target is None:
        target = load_model(config.target, dtype=dtype, device=config.device)
    if config.kind == "model" and draft is None:
        draft = load_model(config.draft_model, dtype=dtype, device=config.device)
    drafter = build_drafter(
        config.kind,
        target,
        config.draft_config(),
        draft_model=config.draft_model if config.kind == "eagle" else draft,
        early_exit_layers=config.early_exit_layers,
        eagle_context=context,
        draft_quantization=config.draft_quantization,
        lookup_min_match=config.lookup_min_match,
    )
    if owned and config.kind == "early-exit":
        keep = config.early_exit_layers or default_early_exit_layers(target)
        del target.model.model.layers[keep:]  # the runner holds the first `keep`; free the rest
        LOG.info("early exit: kept %d of the target's layers", keep)
    return drafter


def start_drafter_process(config: DrafterConfig) -> RunningDrafter:
    """:func:`start_drafter` within this process's settings from ``config`` (threads, collector;
    :mod:`grpc_common.process`): what ``python -m drafter_service`` and the Ray actor run."""
    return start_serving_process(
        lambda: start_drafter(config),
        torch_threads=config.torch_threads,
        gc_thresholds=None,  # CPython's: the drafter's loop allocates little (specdec.gc_policy)
    )


def start_drafter(
    config: DrafterConfig, *, target: LoadedModel | None = None, draft: LoadedModel | None = None
) -> RunningDrafter:
    """Build the drafter, start its scheduler thread and serve it on ``config.host:config.port``.

    ``target`` / ``draft`` let tests and co-located deployments share models already in memory.
    """
    drafter = build_core_drafter(config, target=target, draft=draft)
    metrics = DrafterMetrics()
    scheduler = DraftScheduler(
        drafter,
        max_batch_size=config.max_batch_size,
        batch_wait_s=config.batch_wait_ms / 1000,
        arrival_wait=config.arrival_wait,
        max_open_sequences=config.max_open_sequences,
        metrics=metrics,
        idle_timeout_s=config.sequence_idle_timeout_s or None,
        idle_trim=IdleTrim(config.malloc_trim_idle_s, glibc_malloc_trim()),
    )
    scheduler.start()
    servicer = DrafterServicer(
        scheduler,
        config.kind,
        config.draft_config(),
        max_proposal_nodes=config.max_proposal_nodes,
        max_batch_calls=config.max_batch_calls,
        max_seq_len=config.max_seq_len,
    )
    running = start_service(
        scheduler,
        config,
        lambda grpc_server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, grpc_server),
        [SERVICE_NAME],
        metrics=metrics.registry,
        max_workers=config.max_workers,
    )
    LOG.info("%s drafter for %s serving on %s", config.kind, config.target, running.address)
    return running
