"""Settings the cross-service fault tests share: the real admission service's, with
short hold and pending TTLs, and the Kubernetes substrate's, for the API-server emulator."""

from __future__ import annotations

import json
from typing import Any

from turnstile_testing.kube_emulator import KubeEmulator

NS = "sandboxes"
CLIENT = "acme"
#: Short, so what a fault strands expires within the test (production: 60 s and 120 s).
HOLD_TTL_S = 3.0
PENDING_TTL_S = 4.0


def _service(redis_url: str, redis_prefix: str) -> dict[str, Any]:
    """What every service of these tests shares: loopback, the test's Redis and prefix."""
    return {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "client_allowlist": (CLIENT,),
        "shutdown_grace_s": 1.0,
        "log_format": "text",
    }


def admission_settings(redis_url: str, redis_prefix: str, **overrides: Any) -> dict[str, Any]:
    """The real admission service's settings: limits far above the load (these tests
    count what is left behind, not refusals), short TTLs."""
    return {
        **_service(redis_url, redis_prefix),
        "hold_ttl_s": HOLD_TTL_S,
        "pending_ttl_s": PENDING_TTL_S,
        "cap": {"default_cap": 10_000},
        "rate": {"default_burst": 100_000, "cluster_burst": 100_000},
        "concurrency": {"default_limit": 10_000},
        **overrides,
    }


def as_env(settings: dict[str, Any]) -> dict[str, str]:
    """Settings as ``TURNSTILE_*`` variables, for a service run as a process (groups and
    lists as JSON, which pydantic-settings parses)."""
    return {
        f"TURNSTILE_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
        for name, value in settings.items()
    }


def k8s_env(kube: KubeEmulator, **overrides: str) -> dict[str, str]:
    """The Kubernetes substrate's ``TURNSTILE_K8S_*`` settings for ``kube``: quick
    re-lists, a short leader lease and quick sweeps."""
    return {
        "TURNSTILE_K8S_API_HOST": kube.url,
        "TURNSTILE_K8S_NAMESPACE": NS,
        "TURNSTILE_K8S_RELIST_BACKOFF_S": "0.05",
        "TURNSTILE_K8S_RELIST_BACKOFF_MAX_S": "0.5",
        "TURNSTILE_K8S_LEADER_LEASE_DURATION_S": "3",
        "TURNSTILE_K8S_LEADER_RENEW_DEADLINE_S": "2",
        "TURNSTILE_K8S_LEADER_RETRY_PERIOD_S": "0.5",
        "TURNSTILE_K8S_SWEEP_INTERVAL_S": "0.5",
        **{f"TURNSTILE_K8S_{k.upper()}": v for k, v in overrides.items()},
    }


def substrate_settings(
    redis_url: str, redis_prefix: str, database_url: str, admission_addr: str, **overrides: Any
) -> dict[str, Any]:
    """The Kubernetes substrate's service settings (its ``TURNSTILE_K8S_*`` ones are
    :func:`k8s_env`'s)."""
    return {
        **_service(redis_url, redis_prefix),
        "substrate_kind": "kubernetes",
        "database_url": database_url,
        "health_check_interval_s": 0.2,
        "admission_addr": admission_addr,
        "live_counts_ttl_s": 2.0,
        **overrides,
    }
