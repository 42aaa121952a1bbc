"""Wiring of the affinity process: settings → resources → servicer → server."""

from __future__ import annotations

from turnstile_affinity.attestation import Attestation
from turnstile_affinity.placement import PlacementPolicy, Placer
from turnstile_affinity.relay import Relay
from turnstile_affinity.servicer import AffinityServicer
from turnstile_affinity.settings import AffinitySettings
from turnstile_affinity.store import AffinityStore, Clock
from turnstile_affinity.stream_limits import ATTACH_PATH, AttachLimits, StreamBudgets
from turnstile_affinity.wake import Waker
from turnstile_contracts import affinity_pb2_grpc
from turnstile_platform import peers
from turnstile_platform.decision_log import DecisionLogWriter
from turnstile_platform.health import HealthMonitor
from turnstile_platform.metrics import MetricsEndpoint
from turnstile_platform.redis_client import monitor_redis, redis_from_settings
from turnstile_platform.sandbox_credentials import VerificationKeys
from turnstile_platform.server import GrpcService

SERVICE_NAME = "turnstile-affinity"


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


async def create_app(settings: AffinitySettings, *, clock: Clock | None = None) -> GrpcService:
    """A ready-to-start server for the affinity service.

    ``clock`` shifts the time every store script reads (tests only).
    """
    # Attach streams take their slot at Hello; this many may wait for one (SPEC O6).
    app = GrpcService(
        SERVICE_NAME,
        settings,
        service_names=[peers.AFFINITY],
        self_admitted_streams={ATTACH_PATH: settings.relay_max_waiting_for_hello},
    )
    tiers = settings.tier_config

    redis = redis_from_settings(settings)
    app.add_cleanup(redis.aclose)
    store = AffinityStore(redis, settings.redis_prefix, clock)

    waker = None
    if settings.wake_enabled:
        substrate = peers.substrate(
            settings, app.tracer_provider, timeout_s=settings.wake_timeout_s
        )
        app.add_cleanup(substrate.close)
        # The stub is async at run time; its type stub only says so through __new__.
        stub = substrate.stub
        waker = Waker(stub, settings.wake_timeout_s, settings.wake_wait_margin_s)
        app.add_cleanup(waker.close)

    policy = PlacementPolicy(
        grace_ms=round(settings.grace_s * 1000),
        lease_ttl_ms=_ms(settings.lease_ttl_s),
        record_ttl_ms=settings.affinity_ttl_s * 1000,
        retry_after_s=settings.retry_after_s,
        filtered=tiers.enabled,
    )
    placer = Placer(store, policy, waker, tiers)
    decisions = DecisionLogWriter(redis, settings.redis_prefix, settings.decision_log, "affinity")
    app.add_cleanup(decisions.close)
    app.add_cleanup(placer.close)
    relay = Relay(
        store,
        tiers,
        presence_ttl_ms=_ms(settings.presence_ttl_s),
        mark_ttl_ms=settings.affinity_ttl_s * 1000,
        max_redis_calls=settings.relay_max_redis_calls,
    )
    app.add_cleanup(relay.close)
    app.add_drain_hook(relay.drain)

    keys_file = settings.worker_credential_public_keys_file
    attestation = Attestation(
        settings.worker_attestation, VerificationKeys(keys_file) if keys_file else None
    )
    streams = AttachLimits(
        app.limits,
        hello_timeout_s=settings.relay_hello_timeout_s,
        max_waiting=settings.relay_max_waiting_for_hello,
        budgets=StreamBudgets(
            heartbeats_per_s=settings.relay_heartbeats_per_interval / settings.heartbeat_interval_s,
            heartbeat_burst=settings.relay_heartbeat_burst,
            renewals_per_s=settings.relay_renewals_per_minute / 60,
            renewal_burst=settings.relay_renewal_burst,
        ),
    )
    servicer = AffinityServicer(
        placer=placer,
        relay=relay,
        streams=streams,
        attestation=attestation,
        store=store,
        tiers=tiers,
        heartbeat_interval_ms=_ms(settings.heartbeat_interval_s),
        presence_ttl_ms=_ms(settings.presence_ttl_s),
        retry_after_s=settings.retry_after_s,
        max_connection_age_s=settings.max_connection_age_s,
        decisions=decisions,
    )
    affinity_pb2_grpc.add_AffinityServiceServicer_to_server(servicer, app.server)

    metrics = MetricsEndpoint(settings.host, settings.metrics_port)
    app.add_cleanup(metrics.close)
    monitor = HealthMonitor(app.health, settings.health_check_interval_s, settings.redis_timeout_s)
    monitor_redis(monitor, redis)
    await monitor.start()
    app.add_cleanup(monitor.stop)
    return app
