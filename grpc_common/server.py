"""Starting and stopping a gRPC server with standard health checking, on a port chosen free.

Workers use the threaded server (:func:`start_server`): a call waits on a scheduler thread that owns the model.
The router uses :func:`start_aio_server`, a ``grpc.aio`` server on its event loop: its streams are coroutines, not
one thread each, so hundreds of concurrent streams cost no thread switches. Both bind their port through
:func:`bind`: plaintext, or TLS with the service's :class:`~grpc_common.tls.TlsConfig`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from grpc_common.errors import AsyncDomainErrorInterceptor, DomainErrorInterceptor
from grpc_common.metrics import MetricsServer, start_metrics_server
from grpc_common.tls import PLAINTEXT, TlsConfig

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
SIGNAL_POLL_S = 0.5
MAX_UNACCEPTED_S = 300
MAX_PENDING_CALLS = 100_000


class TerminationSignal:
    """SIGTERM and SIGINT as something a process's main thread waits for: create it (in the main thread) before the
    process says it is ready, then :meth:`wait`.

    Python runs a signal's handler in the main thread, but the kernel may deliver a process-directed signal to any
    thread that does not block it: one of gRPC's, gloo's or torch's. A main thread parked in an untimed wait is then
    never woken to run the handler, and the process ignores its SIGTERM (a tensor-parallel verifier rank did, once
    in a while, until it was killed). :meth:`wait` waits in timed steps, so the handler runs within ``poll_s``
    whichever thread the signal landed on.
    """

    def __init__(self, poll_s: float = SIGNAL_POLL_S) -> None:
        self._received = threading.Event()
        self._poll_s = poll_s
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self._received.set())

    def wait(self) -> None:
        """Return once SIGTERM or SIGINT has arrived."""
        while not self._received.wait(self._poll_s):
            pass


@dataclass
class RunningServer:
    """A started server; ``port`` is the bound port (useful when 0 was asked for)."""

    server: grpc.Server
    health: health.HealthServicer
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def stop(self, grace_s: float = 1.0) -> None:
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()


class Scheduler(Protocol):
    """The thread that owns a worker's model state; stopping it frees every sequence."""

    def stop(self) -> None: ...


class ServiceConfig(Protocol):
    """What the wrapper needs of a service's config."""

    @property
    def grace_s(self) -> float: ...

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...

    @property
    def metrics_port(self) -> int | None: ...

    @property
    def tls(self) -> TlsConfig: ...


SchedulerT = TypeVar("SchedulerT", bound=Scheduler)
ConfigT = TypeVar("ConfigT", bound=ServiceConfig)


@dataclass
class RunningService(Generic[SchedulerT, ConfigT]):
    """A serving worker: ``address`` to dial, ``metrics_address`` to scrape (if served), ``stop()`` to drain it."""

    server: RunningServer
    scheduler: SchedulerT
    config: ConfigT
    metrics: MetricsServer | None = None

    @property
    def address(self) -> str:
        return self.server.address

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the ``/metrics`` endpoint; None when the service serves no metrics."""
        return self.metrics.address if self.metrics is not None else None

    def stop(self, grace_s: float | None = None) -> None:
        """Health NOT_SERVING, in-flight calls get ``grace_s`` (default: the service's) to finish, then the
        scheduler stops and frees every sequence."""
        self.server.stop(self.config.grace_s if grace_s is None else grace_s)
        self.scheduler.stop()
        if self.metrics is not None:
            self.metrics.stop()

    def __enter__(self) -> RunningService[SchedulerT, ConfigT]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_service(
    scheduler: SchedulerT,
    config: ConfigT,
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    *,
    metrics: CollectorRegistry,
    max_workers: int,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> RunningService[SchedulerT, ConfigT]:
    """Serve a worker whose ``scheduler`` is started: its gRPC server on ``config.host:config.port`` and, when
    ``config.metrics_port`` is set, its ``metrics`` registry; if either fails to start, stop what was started."""
    metrics_server: MetricsServer | None = None
    try:
        if config.metrics_port is not None:
            metrics_server = start_metrics_server(metrics, config.host, config.metrics_port)
        server = start_server(
            register,
            service_names,
            host=config.host,
            port=config.port,
            max_workers=max_workers,
            max_message_bytes=max_message_bytes,
            tls=config.tls,
        )
    except BaseException:
        scheduler.stop()
        if metrics_server is not None:
            metrics_server.stop()
        raise
    return RunningService(server, scheduler, config, metrics_server)


def start_server(
    register: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 64,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: TlsConfig = PLAINTEXT,
) -> RunningServer:
    """Start a threaded server with ``register``'s servicers, the error interceptor and grpc.health.v1; with ``tls``
    enabled only clients with a certificate from its CA get through the handshake."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[DomainErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = bind(server, host, port, tls)
    server.start()
    for name in ("", *service_names):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, health_servicer, host, bound)


def bind(
    server: grpc.Server | grpc.aio.Server, host: str, port: int, tls: TlsConfig, *, require_client_auth: bool = True
) -> int:
    """Add ``host:port`` to ``server`` (plaintext, or TLS when ``tls`` is enabled); the bound port."""
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if tls.enabled:
        bound = server.add_secure_port(target, tls.server_credentials(require_client_auth=require_client_auth))
    else:
        bound = server.add_insecure_port(target)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return bound


@dataclass
class RunningAioServer:
    """A started ``grpc.aio`` server; use it (and :meth:`stop`) on the loop it was started on."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def stop(self, grace_s: float = 1.0) -> None:
        """Health NOT_SERVING, then in-flight RPCs get ``grace_s`` to finish before they are cancelled."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_aio_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tls: TlsConfig = PLAINTEXT,
    require_client_auth: bool = True,
) -> RunningAioServer:
    """Start a ``grpc.aio`` server on the running loop with ``register``'s servicers, the error interceptor and
    grpc.health.v1; TLS with ``tls`` enabled, asking clients for a certificate of its CA if ``require_client_auth``."""
    server = grpc.aio.server(
        interceptors=[AsyncDomainErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # gRPC core CANCELs calls beyond 1000 not yet taken by the application; a burst of thousands of
            # streams must reach the router's own admission control (RESOURCE_EXHAUSTED with a retry hint)
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
            # grpc.aio takes one new call per turn of the event loop; a loop saturated by hundreds of streams
            # turns a few dozen times a second, so a burst waits in core longer than core's default 30 s (after
            # which it CANCELs the call unseen) before admission control can queue or refuse it
            ("grpc.server_max_unrequested_time_in_server", MAX_UNACCEPTED_S),
        ],
    )
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = bind(server, host, port, tls, require_client_auth=require_client_auth)
    await server.start()
    for name in ("", *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningAioServer(server, health_servicer, host, bound)
