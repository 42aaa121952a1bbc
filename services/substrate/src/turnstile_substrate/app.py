"""Wiring of the substrate process: settings → resources → servicer → server."""

from __future__ import annotations

import logging

from opentelemetry.sdk.trace import TracerProvider

from turnstile_clientkeys import Resolver, watch_keyset
from turnstile_clientkeys.live_store import LiveStore
from turnstile_contracts import substrate_pb2_grpc
from turnstile_platform import peers
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.bounded import report_breaker
from turnstile_platform.decision_log import DecisionLogWriter
from turnstile_platform.health import Check, HealthMonitor
from turnstile_platform.metrics import MetricsEndpoint
from turnstile_platform.redis_client import monitor_redis, redis_from_settings
from turnstile_platform.sandbox_credentials import CredentialIssuer, SigningKey
from turnstile_platform.server import GrpcService
from turnstile_substrate.activation import Activator
from turnstile_substrate.admission_client import AdmissionClient
from turnstile_substrate.claim_sweep import StaleClaimSweep
from turnstile_substrate.db.pool import create_pool
from turnstile_substrate.db.records import fetch_owner
from turnstile_substrate.runtime import Substrate
from turnstile_substrate.servicer import SubstrateServicer
from turnstile_substrate.settings import SubstrateSettings
from turnstile_substrate.substrates import add_sweeps, create_leadership, create_substrate

SERVICE_NAME = "turnstile-substrate"

log = logging.getLogger(__name__)


async def create_app(
    settings: SubstrateSettings, *, tracer_provider: TracerProvider | None = None
) -> GrpcService:
    """A ready-to-start server for the substrate service.

    Redis holds the live counts admission's cap reads (on Direct, only the marker
    saying this substrate cannot count), the key set the Kubernetes reflector
    counts by, and sandbox credentials' revocation records.
    """
    app = GrpcService(
        SERVICE_NAME, settings, service_names=[peers.SUBSTRATE], tracer_provider=tracer_provider
    )
    monitor = HealthMonitor(
        app.health, settings.health_check_interval_s, settings.database_timeout_s
    )
    metrics = MetricsEndpoint(settings.host, settings.metrics_port)
    app.add_cleanup(metrics.close)

    resolver = Resolver()
    signing_key_file = settings.worker_credential_signing_key_file
    redis = redis_from_settings(settings)
    app.add_cleanup(redis.aclose)
    if settings.substrate_kind == "kubernetes" or signing_key_file is not None:
        # Direct without credentials only keeps its live-count marker in Redis: an
        # outage lets it lapse (the cap then counts pending alone), not a reason to
        # stop serving.
        monitor_redis(monitor, redis)
    credentials = None
    if signing_key_file is not None:
        credentials = CredentialIssuer(
            SigningKey.from_file(signing_key_file),
            redis,
            settings.redis_prefix,
            ttl_s=settings.worker_credential_ttl_s,
        )
    watcher = None
    if settings.substrate_kind == "kubernetes" or settings.direct_live_counts == "count":
        # The live counts are by bounded key: the resolver follows the key set.
        watcher = await watch_keyset(
            redis,
            settings.redis_prefix,
            resolver,
            allowlist=settings.client_allowlist,
            poll_interval_s=settings.keyset_poll_interval_s,
        )
        app.add_cleanup(watcher.stop)

    pool = await create_pool(settings)
    app.add_cleanup(pool.close)

    async def postgres_ok() -> bool:
        async with pool.acquire() as conn:
            await conn.fetchval("SELECT 1")
        return True

    monitor.add("postgres", postgres_ok)
    report_breaker(app.health, "postgres", pool.guard.breaker)

    admission = AdmissionClient(
        peers.admission(settings, app.tracer_provider),
        retry_after_s=settings.retry_after_s,
        timeout_s=settings.rpc_timeout_s,
    )
    app.add_cleanup(admission.close)

    # One leader per process for once-per-cluster work (warm pool, sweeps, credential
    # renewal): elected over a Lease for Kubernetes, always this process for Direct (one
    # host, no election).
    leadership, close_leadership = await create_leadership(settings)
    app.add_cleanup(close_leadership)
    substrate = create_substrate(settings, resolver, leadership, credentials, admission)
    await substrate.start()
    app.add_cleanup(substrate.close)
    if watcher is not None:
        # A new key set moves live sandboxes between keys: publish them again.
        watcher.add_listener(lambda _keyset: substrate.key_set_changed())
    add_sweeps(settings, substrate, leadership, pool, admission.release_sandbox)
    # Leader-only: the live counts admission's cap reads (on Direct, its runtimes or
    # the marker that says it does not count them).
    live_counts = LiveStore(redis, settings.redis_prefix, state_ttl_s=settings.live_counts_ttl_s)
    leadership.add_work(
        "live-counts", substrate.live_counts_work(live_counts, settings.live_counts_chunk)
    )
    stale_claims = StaleClaimSweep(
        pool,
        expired_for_s=settings.activation_claim_max_s,
        interval_s=settings.activation_claim_max_s,
        database_timeout_s=settings.database_timeout_s,
    )
    leadership.add_work("stale-activation-claims", stale_claims.run)
    # On every replica: the candidacy (Kubernetes) or the always-leading loop (Direct),
    # which starts and stops the leader-only work above. Closed before the substrate
    # closes: leader work stops, a held lease is released.
    leading = BackgroundTasks("substrate leadership")
    leading.spawn(leadership.run(), name="leadership")
    app.add_cleanup(leading.close)
    monitor.add("substrate", _ready(substrate))

    if app.authorizer is not None:
        # Sandbox-addressed calls of scoped callers act for the sandbox's recorded
        # client (SPEC Z2, O1); callers allowed any client never get here.
        async def owner(sandbox_id: str) -> str | None:
            async with pool.acquire(timeout=settings.database_timeout_s) as conn:
                return await fetch_owner(conn, sandbox_id)

        app.authorizer.set_owner_lookup(owner)

    decisions = DecisionLogWriter(redis, settings.redis_prefix, settings.decision_log, "substrate")
    app.add_cleanup(decisions.close)
    activator = Activator(substrate, pool, admission, settings, decisions)
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(
        SubstrateServicer(
            activator, resolver, settings.tier_config, settings.admission_wait_margin_s
        ),
        app.server,
    )
    await monitor.start()
    app.add_cleanup(monitor.stop)
    log.info("substrate ready", extra={"substrate": substrate.name})
    return app


def _ready(substrate: Substrate) -> Check:
    async def check() -> bool:
        return substrate.ready()

    return check
