"""The grpc.aio server bootstrap every Turnstile service starts with (SPEC X3).

It wires, in one place: health driven by a component map, server reflection, mutual
TLS and per-method authorization (SPEC Z1, Z2), keepalive, a maximum connection age
and message size, the call limits shared by priority levels and flows
(:mod:`turnstile_platform.call_limits`, SPEC N1), the one platform interceptor
(:mod:`turnstile_platform.interceptors`)
and the event-loop lag monitor (:mod:`turnstile_platform.loop_lag`). Without its
certificate and policy files an mTLS process refuses to start; ``plaintext`` listens
only on loopback with no authorization; an optional plaintext ``health_port`` serves
health alone, for kubelet probes.

Shutdown is staged, each stage bounded: health goes NOT_SERVING; after
``shutdown_drain_delay_s`` drain hooks tell long-lived streams to end (a relay's
workers move now, not when the grace runs out), the server stops accepting and
in-flight calls get ``shutdown_grace_s``; cleanups run in reverse order; the lag
monitor stops and the tracer provider flushes. docs/architecture.md ("One process").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Mapping

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from turnstile_platform import reflection, tls, tracing
from turnstile_platform.authz.authorizer import Authorizer
from turnstile_platform.authz.methods import all_methods
from turnstile_platform.authz.watcher import POLICY_HEALTH_NAME, PolicyWatcher
from turnstile_platform.call_limits import CallLimits
from turnstile_platform.health import HealthMap
from turnstile_platform.interceptors import PlatformInterceptor
from turnstile_platform.loop_lag import LoopLagMonitor
from turnstile_platform.settings import ServiceSettings

log = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[object]]


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def connection_options(settings: ServiceSettings, backlog: int) -> list[tuple[str, int]]:
    """gRPC server arguments for keepalive, the maximum connection age, and how long
    and how many arrived calls may wait to be taken up.

    Keepalive finds connections whose peer vanished without a FIN; the maximum
    age (with its grace) makes clients reconnect now and then, so they spread
    over replicas that came up after them.

    grpc.aio takes arrived calls up one at a time, each on a turn of the event
    loop; the rest wait inside gRPC, which cancels any that waited longer than
    ``grpc.server_max_unrequested_time_in_server`` (30 s unless set). A replica
    whose loop is starved (docs/operations.md, "When a dependency fails") can
    take longer than that, and the caller then gets CANCELLED from a handler
    that never ran. ``call_accept_wait_s`` raises the limit past callers'
    deadlines, so theirs decides.

    gRPC also bounds how many such calls may wait: past 1,000 it cancels arrivals
    at random, and all of them past 3,000 (``grpc.server.max_pending_requests`` and
    its hard limit), again CANCELLED from a handler that never ran. A burst of
    thousands of calls at once (10,000 ``Admit``s joining the fair queue over three
    replicas lost a tenth to a fifth of them so) is what a replica's call limits
    exist to answer, with a rich refusal once they are full. So the wait is
    bounded at ``backlog``, the server's own cap on calls at once: every call up to
    it is taken up in turn, and the interceptor, not gRPC, refuses what is over.
    """
    options = [
        ("grpc.server_max_unrequested_time_in_server", settings.call_accept_wait_s),
        ("grpc.server.max_pending_requests", backlog),
        ("grpc.server.max_pending_requests_hard_limit", backlog),
        ("grpc.keepalive_time_ms", _ms(settings.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", _ms(settings.keepalive_timeout_s)),
        ("grpc.keepalive_permit_without_calls", 1),
        (
            "grpc.http2.min_ping_interval_without_data_ms",
            _ms(settings.keepalive_min_ping_interval_s),
        ),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if settings.max_connection_age_s > 0:
        options.append(("grpc.max_connection_age_ms", _ms(settings.max_connection_age_s)))
        if settings.max_connection_age_grace_s > 0:
            grace = _ms(settings.max_connection_age_grace_s)
            options.append(("grpc.max_connection_age_grace_ms", grace))
    return options


class GrpcService:
    """One service process's gRPC server and its lifecycle.

    ``service_names`` are the full names of the servicers added (used for health
    and reflection). Add servicers through :attr:`server` before :meth:`start`.
    ``self_admitted_streams``: stream methods whose handlers take their own slot
    of :attr:`limits`, and how many of each may wait to (:mod:`.call_limits`).
    """

    def __init__(
        self,
        name: str,
        settings: ServiceSettings,
        *,
        service_names: Iterable[str],
        tracer_provider: TracerProvider | None = None,
        self_admitted_streams: Mapping[str, int] | None = None,
    ) -> None:
        self.name = name
        self.settings = settings
        self.service_names = list(service_names)
        self.tracer_provider = tracer_provider or tracing.create_tracer_provider(name)
        self.health = HealthMap(self.service_names)
        self.port = 0
        self._cleanups: list[Cleanup] = []
        self._drain_hooks: list[Cleanup] = []
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self.tls_files = tls.server_files(settings, settings.host, name)
        #: The live policy (None in plaintext mode).
        self.policy: PolicyWatcher | None = None
        #: The authorization check (None in plaintext mode); services with
        #: sandbox-addressed calls give it their owner lookup.
        self.authorizer: Authorizer | None = None
        #: How late the loop runs (every replica, from start until shutdown ends).
        self.loop_lag = LoopLagMonitor(settings.loop_lag_interval_s)
        self.limits = CallLimits(
            unary=settings.max_concurrent_rpcs,
            streams=settings.max_concurrent_streams,
            retry_after_s=settings.retry_after_s,
            self_admitted=self_admitted_streams,
            fair_share=settings.fair_share,
        )
        if self.tls_files is not None:
            if settings.authz_policy_file is None:
                raise tls.TransportSecurityError(
                    f"{name}: mutual TLS needs an authorization policy "
                    "(TURNSTILE_AUTHZ_POLICY_FILE); without one every call would be denied"
                )
            self.policy = PolicyWatcher(
                settings.authz_policy_file,
                poll_interval_s=settings.authz_poll_interval_s,
                known_methods=all_methods(),
            )
            self.authorizer = Authorizer(self.policy)
        interceptor = PlatformInterceptor(
            spans=tracing.ServerSpans(self.tracer_provider),
            limits=self.limits,
            authorizer=self.authorizer,
            retry_after_s=settings.retry_after_s,
        )
        self._health_server: grpc.aio.Server | None = None
        self.health_port = 0
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *connection_options(settings, self.limits.server_cap),
        ]
        self.server = grpc.aio.server(
            interceptors=[interceptor],
            options=options,
            maximum_concurrent_rpcs=self.limits.server_cap,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        reflection.enable(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name],
            self.server,
        )

    def add_cleanup(self, cleanup: Cleanup) -> None:
        """Run ``cleanup`` at shutdown, after calls drained (last added runs first)."""
        self._cleanups.append(cleanup)

    def add_drain_hook(self, hook: Cleanup) -> None:
        """Run ``hook`` when shutdown begins draining, before the server stops."""
        self._drain_hooks.append(hook)

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        bind = f"{self.settings.host}:{self.settings.port}"
        if self.tls_files is None:
            self.port = self.server.add_insecure_port(bind)
        else:
            self.port = self.server.add_secure_port(bind, tls.server_credentials(self.tls_files))
        if self.settings.health_port:
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self._health_server)
            self.health_port = self._health_server.add_insecure_port(
                f"{self.settings.host}:{self.settings.health_port}"
            )
            await self._health_server.start()
        await self.server.start()
        self.loop_lag.start()
        await self.health.start()
        if self.policy is not None:
            await self._publish_policy(self.policy.valid)
            self.policy.on_validity(self._publish_policy)
            self.policy.start()
            self.add_cleanup(self.policy.stop)
        log.info("serving", extra={"service": self.name, "address": self.address})
        return self.port

    async def _publish_policy(self, valid: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if valid
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.servicer.set(POLICY_HEALTH_NAME, status)

    def request_stop(self) -> None:
        """Ask :meth:`wait` to begin the staged shutdown (signal-safe)."""
        self._stopping.set()

    async def wait(self) -> None:
        """Serve until :meth:`request_stop` (SIGTERM/SIGINT), then shut down."""
        await self._stopping.wait()
        await self.stop()

    async def serve(self) -> None:
        """Start, install SIGTERM/SIGINT handlers, and serve until one arrives."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        await self.start()
        try:
            await self.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def stop(self) -> None:
        """The staged shutdown described in the module docstring. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        settings = self.settings
        log.info("shutting down: health NOT_SERVING", extra={"service": self.name})
        await self.health.enter_shutdown()
        if settings.shutdown_drain_delay_s > 0:
            await asyncio.sleep(settings.shutdown_drain_delay_s)
        for hook in self._drain_hooks:
            try:
                await hook()
            except Exception:
                log.exception("drain hook failed during shutdown")
        log.info("draining in-flight calls", extra={"grace_s": settings.shutdown_grace_s})
        await self.server.stop(settings.shutdown_grace_s)
        if self._health_server is not None:
            await self._health_server.stop(None)
        for cleanup in reversed(self._cleanups):
            try:
                await asyncio.wait_for(cleanup(), timeout=max(1.0, settings.shutdown_grace_s))
            except Exception:
                log.exception("cleanup failed during shutdown")
        self.loop_lag.stop()
        # Exporters block on network I/O: flush them off the event loop.
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.tracer_provider.force_flush, 5000)
            await asyncio.to_thread(self.tracer_provider.shutdown)
        log.info("stopped", extra={"service": self.name})
