"""Wiring of the admission process: settings → resources → servicer → server."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from turnstile_admission.admin import Admin
from turnstile_admission.admin_servicer import AdminServicer
from turnstile_admission.admitter import Admitter
from turnstile_admission.audit import AuditLog
from turnstile_admission.metrics import forget_departed_keys
from turnstile_admission.redis_store import AdmissionStore
from turnstile_admission.servicer import AdmissionServicer
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import Resolver, watch_keyset
from turnstile_contracts import admission_pb2_grpc
from turnstile_platform import peers, tracing
from turnstile_platform.health import HealthMonitor
from turnstile_platform.metrics import MetricsEndpoint
from turnstile_platform.redis_client import monitor_redis, redis_from_settings
from turnstile_platform.server import GrpcService

SERVICE_NAME = "turnstile-admission"


async def create_app(
    settings: AdmissionSettings, *, tracer_provider: TracerProvider | None = None
) -> GrpcService:
    """A ready-to-start server for the admission service.

    Needs Redis at start (to load the key set); after that, each policy's fail
    mode decides what an unreachable Redis means.
    """
    provider = tracer_provider or tracing.create_tracer_provider(SERVICE_NAME)
    app = GrpcService(
        SERVICE_NAME,
        settings,
        service_names=[peers.ADMISSION, peers.ADMIN],
        tracer_provider=provider,
    )
    redis = redis_from_settings(settings)
    app.add_cleanup(redis.aclose)
    resolver = Resolver()
    watcher = await watch_keyset(
        redis,
        settings.redis_prefix,
        resolver,
        allowlist=settings.client_allowlist,
        poll_interval_s=settings.keyset_poll_interval_s,
    )
    app.add_cleanup(watcher.stop)
    watcher.add_listener(forget_departed_keys)
    # No substrate peer: the cap's live count is read inside the decision script,
    # from the live sets the substrate's leader keeps in Redis (SPEC S4).
    admitter = Admitter(settings, AdmissionStore(redis, settings), resolver)
    app.add_cleanup(admitter.orphans.close)
    app.add_cleanup(admitter.queue.close)
    if admitter.queue.enabled:
        admitter.queue.watch_fairness()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(
        AdmissionServicer(admitter), app.server
    )
    # The admin API (SPEC M1): the one writer of the limits and the key set.
    audit = AuditLog(redis, settings.redis_prefix, settings.decision_log)
    admission_pb2_grpc.add_AdminServiceServicer_to_server(
        AdminServicer(Admin(redis, settings.redis_prefix, resolver, audit)), app.server
    )
    metrics = MetricsEndpoint(settings.host, settings.metrics_port)
    app.add_cleanup(metrics.close)
    monitor = HealthMonitor(app.health, settings.health_check_interval_s, settings.redis_timeout_s)
    # Reported (the "redis" health name, the breaker metrics), but not in readiness:
    # taking every replica out of rotation would turn each fail-open policy into a
    # refusal at the transport, and a fail-closed one's retry hint into nothing.
    monitor_redis(monitor, redis, readiness=False)
    await monitor.start()
    app.add_cleanup(monitor.stop)
    return app
