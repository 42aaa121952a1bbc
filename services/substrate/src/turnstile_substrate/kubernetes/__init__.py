"""The Kubernetes substrate: sandbox pods, a reflector with O(1) counts, a warm pool.

Modules, each one concern:

* :mod:`.settings` — ``KubernetesSettings`` (``TURNSTILE_K8S_*``);
* :mod:`.tier_runtime` — what each tier's pods run on (RuntimeClass, resources, nodes);
* :mod:`.podinfo` — the few pod fields the substrate needs, parsed from raw JSON;
* :mod:`.index` — the cache and its per-client-id / per-bounded-key / warm indexes;
* :mod:`.api` — pod calls over kubernetes-asyncio without client models;
* :mod:`.reflector` — list-then-watch with bookmarks, re-list on 410 and disconnect;
* :mod:`.template` — pod manifests and the adoption patch;
* :mod:`.warmpool` — warm-pool claims (optimistic adoption, invalidation) and refill;
* :mod:`.tasks` — clean-ups that survive their caller's cancellation;
* :mod:`.metrics` — Prometheus metrics (bounded labels);
* :mod:`.credentials` — sandbox credentials in per-pod Secrets, renewed by the leader;
* :mod:`.sweeps` — the leader's sweeps (orphan, finished, expired pods; gone runtimes);
* :mod:`.gone_watch` — the leader ends a gone pod's execution as soon as the reflector sees it;
* :mod:`.substrate` — ``KubernetesSubstrate``, the ``Substrate`` on pods.

``create_leadership`` builds the process's leader elector (its own API connection, so
lease renewals never queue behind pod calls); the substrate registers its leader-only
work (warm-pool refill and trim, sweeps, the gone-runtime watch) on it.
"""

from collections.abc import Awaitable, Callable

import asyncpg

from turnstile_clientkeys import Resolver
from turnstile_platform.leader import LeaderElector, Leadership, default_identity
from turnstile_platform.sandbox_credentials import CredentialIssuer
from turnstile_substrate.admission_client import AdmissionClient
from turnstile_substrate.kubernetes.api import connect
from turnstile_substrate.kubernetes.gone_watch import GoneRuntimeWatch
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.substrate import KubernetesSubstrate
from turnstile_substrate.kubernetes.sweeps import Release
from turnstile_substrate.runtime import Substrate
from turnstile_substrate.settings import SubstrateSettings

Closer = Callable[[], Awaitable[None]]

__all__ = [
    "KubernetesSettings",
    "KubernetesSubstrate",
    "add_sweeps",
    "create_leadership",
    "create_substrate",
]


async def create_leadership(settings: SubstrateSettings) -> tuple[Leadership, Closer]:
    """The replica's :class:`LeaderElector` over the ``TURNSTILE_K8S_LEADER_*`` Lease, and
    the closer of its API connection (call it after the elector has stopped)."""
    del settings
    k8s_settings = KubernetesSettings()
    api_client = await connect(k8s_settings)
    elector = LeaderElector(
        api_client,
        namespace=k8s_settings.leader_lease_namespace or k8s_settings.namespace,
        lease_name=k8s_settings.leader_lease_name,
        identity=k8s_settings.leader_identity or default_identity(),
        lease_duration_s=k8s_settings.leader_lease_duration_s,
        renew_deadline_s=k8s_settings.leader_renew_deadline_s,
        retry_period_s=k8s_settings.leader_retry_period_s,
    )
    return elector, api_client.close


def create_substrate(
    settings: SubstrateSettings,
    resolver: Resolver,
    leadership: Leadership | None = None,
    credentials: CredentialIssuer | None = None,
    admission: AdmissionClient | None = None,
) -> Substrate:
    """The factory :mod:`turnstile_substrate.substrates` calls when
    ``TURNSTILE_SUBSTRATE_KIND=kubernetes``. The Kubernetes substrate reads its own
    ``TURNSTILE_K8S_*`` settings (invalid ones stop start-up, naming the variable, as does a
    tier runtime for a tier ``TURNSTILE_TIERS`` does not declare);
    the resolver is the service's, kept on the current key set; ``credentials`` (when a
    signing key is configured) puts each pod's sandbox credential in a Secret; the warm-pool
    refill reserves each pod's creation through ``admission`` (SPEC W3)."""
    k8s_settings = KubernetesSettings()
    undeclared = k8s_settings.undeclared_tiers(settings.tier_config.declared)
    if undeclared:
        raise ValueError(
            f"TURNSTILE_K8S_TIER_RUNTIMES: {', '.join(map(repr, undeclared))} "
            f"not declared in TURNSTILE_TIERS ({', '.join(settings.tier_config.declared)})"
        )
    return KubernetesSubstrate(
        k8s_settings,
        resolver,
        leadership=leadership,
        credentials=credentials,
        credential_renew_interval_s=settings.worker_credential_renew_interval_s,
        admission=admission,
    )


def add_sweeps(
    substrate: Substrate,
    leadership: Leadership,
    pool: asyncpg.Pool,
    release: Release,
    database_timeout_s: float,
) -> GoneRuntimeWatch:
    """Register the sweeps of a started Kubernetes substrate as leader work, and their prompt
    path for pods the reflector sees go (:mod:`.gone_watch`)."""
    assert isinstance(substrate, KubernetesSubstrate)
    sweeper = substrate.sweeper(pool, release, database_timeout_s=database_timeout_s)
    leadership.add_work("sweeps", sweeper.run)
    watch = GoneRuntimeWatch(substrate.index, sweeper, substrate.reflector.synced)
    leadership.add_work("gone-runtimes", watch.run)
    return watch
