"""Process wiring: the router's event loop, its worker pool, the public gRPC server and the HTTP server.

``start_router(config)`` returns a :class:`RunningRouter` once both servers accept requests; tests use it
in-process. Its ``grpc.health.v1`` answers two questions: the overall service ``""`` (:data:`LIVENESS_SERVICE`) is
SERVING while the process serves, until it drains; ``specdec.v1.Router`` (:data:`READINESS_SERVICE`) is SERVING
only while at least one verifier is healthy (what ``GET /health`` says too), so a Kubernetes readiness probe on it
keeps a router that cannot serve out of its Service without a liveness probe restarting it.

Everything runs on one event loop in a background thread (uvloop where installed, :mod:`specdec.eventloop`):
worker calls (``grpc.aio`` clients), the public gRPC server (``grpc.aio``, with ``grpc.health.v1``) and aiohttp's
HTTP server; with TLS configured, the worker channels are mutual TLS and both public servers serve TLS
(:mod:`grpc_common.tls`). No thread per stream: one loop holds a thousand concurrent streams.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from grpc_health.v1 import health_pb2
from transformers import PreTrainedTokenizerBase

from grpc_common.process import start_serving_process
from grpc_common.server import RunningAioServer, start_aio_server
from router.config import RouterConfig
from router.frontend import Frontend
from router.http import build_app
from router.servicer import SERVICE_NAME, RouterServicer, add_to_server
from router.workers import WorkerPool
from specdec import eventloop
from specdec.adaptive import SpeculationController
from specdec.model_files import load_tokenizer

LOG = logging.getLogger(__name__)
T = TypeVar("T")

LIVENESS_SERVICE = ""  # grpc.health.v1 service name: the process serves (until it drains)
READINESS_SERVICE = SERVICE_NAME  # grpc.health.v1 service name: the router can serve a request now


class EventLoopThread:
    """An asyncio loop running in a daemon thread; :meth:`run` executes a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = eventloop.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@dataclass
class RunningRouter:
    """A started router; ``stop()`` drains it gracefully (health NOT_SERVING, in-flight requests get the grace)."""

    config: RouterConfig
    frontend: Frontend
    grpc_server: RunningAioServer
    http_runner: web.AppRunner
    http_address: str
    loop_thread: EventLoopThread

    @property
    def grpc_address(self) -> str:
        return self.grpc_server.address

    def set_workers(self, verifiers: list[str], drafters: list[str]) -> None:
        """Serve with exactly these workers from now on (:meth:`router.workers.WorkerPool.set_workers`)."""
        self.loop_thread.run(self.frontend.pool.set_workers(verifiers, drafters))

    def stop(self, grace_s: float | None = None) -> None:
        """Stop taking requests, give those in flight ``grace_s`` (default: the config's) to finish, release all."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.frontend.draining = True
        # health NOT_SERVING, then in-flight RPCs get the grace, then are cancelled
        self.loop_thread.run(self.grpc_server.stop(grace))
        self.loop_thread.run(self._stop_on_loop(grace))
        self.loop_thread.stop()

    async def _stop_on_loop(self, grace_s: float) -> None:
        await self.http_runner.cleanup()  # waits up to the runner's shutdown_timeout for handlers
        await self.frontend.pool.stop_health_checks()
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if others:  # requests cancelled by the servers still close their sequences on the workers
            await asyncio.wait(others, timeout=max(grace_s, 1.0))
        await self.frontend.pool.close()


def start_router_process(config: RouterConfig) -> RunningRouter:
    """:func:`start_router` within this process's settings (its collector, :mod:`grpc_common.process`): what
    ``python -m router`` and the Ray actor run."""
    return start_serving_process(lambda: start_router(config))


def start_router(
    config: RouterConfig,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    controller: SpeculationController | None = None,
) -> RunningRouter:
    """Start the router described by ``config``; ``tokenizer`` (else loaded from ``config.tokenizer``) is for text;
    ``controller`` (else one from the config) chooses the draft lengths of ``auto`` requests.

    Workers are checked once before serving; ones that are down are retried by the health loop.
    """
    if tokenizer is None and config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
    loop_thread = EventLoopThread()
    try:
        pool = loop_thread.run(WorkerPool.start(config))
        frontend = Frontend(config, tokenizer, pool, controller)
        http_runner, http_address = loop_thread.run(_start_http(frontend))
        grpc_server = loop_thread.run(
            start_aio_server(
                lambda server: add_to_server(RouterServicer(frontend), server),
                [READINESS_SERVICE],
                host=config.host,
                port=config.grpc_port,
                tls=config.tls,
                require_client_auth=config.tls_public_client_auth,
            )
        )
        loop_thread.run(_publish_readiness(frontend, grpc_server))
    except BaseException:
        loop_thread.stop()
        raise
    LOG.info(
        "router serving %s: gRPC %s, HTTP %s, %s loop",
        config.model,
        grpc_server.address,
        http_address,
        eventloop.loop_name(loop_thread.loop),
    )
    return RunningRouter(config, frontend, grpc_server, http_runner, http_address, loop_thread)


async def _publish_readiness(frontend: Frontend, grpc_server: RunningAioServer) -> None:
    """Set :data:`READINESS_SERVICE` from ``frontend.ready()`` now and whenever a worker enters or leaves rotation."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()

    async def publish() -> None:
        await grpc_server.health.set(READINESS_SERVICE, serving if frontend.ready() else not_serving)

    def changed() -> None:
        task = loop.create_task(publish())
        pending.add(task)  # keep a reference until it ran
        task.add_done_callback(pending.discard)

    frontend.pool.on_health_change = changed
    await publish()


async def _start_http(frontend: Frontend) -> tuple[web.AppRunner, str]:
    config = frontend.config
    runner = web.AppRunner(
        build_app(frontend), handler_cancellation=True, shutdown_timeout=config.shutdown_grace_s, access_log=None
    )
    await runner.setup()
    tls = config.tls
    context = tls.http_context(require_client_auth=config.tls_public_client_auth) if tls.enabled else None
    site = web.TCPSite(runner, config.host, config.http_port, ssl_context=context)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
