"""The few fields of a pod the substrate needs, parsed straight from API JSON.

The reflector holds one :class:`PodInfo` per pod instead of a client model
(``V1Pod``): building models for every list item and watch event costs far more
CPU and memory than reading seven fields out of the decoded JSON (the benchmark
``bench_reflector.py`` measures both). Repeated strings (tier, phase, client id,
namespace) are interned so 50,000 cached pods share them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from turnstile_substrate.kubernetes.template import ANNOTATION_RESTORE, ANNOTATION_WARM_PAID
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_ORIGIN,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TEMPLATE,
    LABEL_TIER,
)

#: Phases of a pod that has stopped for good: it no longer counts as live.
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})

_intern = sys.intern


@dataclass(frozen=True, slots=True)
class PodInfo:
    """One cached pod: identity, the Turnstile labels, and liveness."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    #: ``turnstile.dev/sandbox-id``; None on a warm (unclaimed) pod.
    sandbox_id: str | None
    #: ``turnstile.dev/client-id``; None when the label is absent (charged as unattributed).
    client_label: str | None
    #: ``turnstile.dev/tier``; "" when absent.
    tier: str
    #: ``turnstile.dev/pool`` is present: a pre-created pod waiting to be claimed.
    pooled: bool
    phase: str
    #: ``metadata.deletionTimestamp`` is set: the pod is terminating.
    deleting: bool
    #: ``spec.nodeName``; "" until scheduled.
    node: str
    #: ``metadata.creationTimestamp`` as sent (RFC 3339); parsed only by the sweeps,
    #: so the reflector's hot path pays nothing for it.
    created: str = ""
    #: ``turnstile.dev/template`` (warm pods): the hash of the template that made it; "" when
    #: absent.
    template: str = ""
    #: ``status.podIP``; "" until the pod is scheduled and has one (its credential's
    #: endpoint, SPEC O3).
    ip: str = ""
    #: ``turnstile.dev/origin`` is ``warm-pool``: the warm pool made it (claimed or not).
    from_pool: bool = False
    #: ``turnstile.dev/restore`` is ``true``: created to restore a sandbox (never a warm pod's
    #: work, so not warm-pool demand).
    restore: bool = False
    #: ``turnstile.dev/warm-paid`` is ``true``: a warm pod whose creation admission's
    #: ReserveWarm paid (SPEC W3).
    paid: bool = False

    def age_s(self, now: datetime | None = None) -> float | None:
        """Seconds since the pod was created, or None when that is unknown."""
        if not self.created:
            return None
        try:
            created = datetime.fromisoformat(self.created.replace("Z", "+00:00"))
        except ValueError:
            return None
        return ((now or datetime.now(UTC)) - created).total_seconds()

    @property
    def live(self) -> bool:
        """Counts against a client: not terminating and not finished."""
        return not self.deleting and self.phase not in FINISHED_PHASES

    @property
    def is_sandbox(self) -> bool:
        """A live pod that runs a sandbox (what the per-client counts are made of)."""
        return self.sandbox_id is not None and self.live

    @property
    def is_warm(self) -> bool:
        """A live, unclaimed warm-pool pod."""
        return self.pooled and self.sandbox_id is None and self.live


def parse_pod(obj: dict[str, Any]) -> PodInfo:
    """A :class:`PodInfo` from a decoded pod object (list item or watch event)."""
    meta = obj["metadata"]
    labels = meta.get("labels") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    client = labels.get(LABEL_CLIENT_ID)
    annotations = meta.get("annotations") or {}
    return PodInfo(
        name=meta["name"],
        namespace=_intern(meta.get("namespace", "")),
        uid=meta.get("uid", ""),
        resource_version=meta.get("resourceVersion", ""),
        sandbox_id=labels.get(LABEL_SANDBOX_ID),
        client_label=None if client is None else _intern(client),
        tier=_intern(labels.get(LABEL_TIER, "")),
        pooled=LABEL_POOL in labels,
        phase=_intern(status.get("phase") or "Pending"),
        deleting=meta.get("deletionTimestamp") is not None,
        node=_intern(spec.get("nodeName") or ""),
        created=meta.get("creationTimestamp") or "",
        template=_intern(labels.get(LABEL_TEMPLATE, "")),
        ip=status.get("podIP") or "",
        from_pool=labels.get(LABEL_ORIGIN) == "warm-pool",
        restore=annotations.get(ANNOTATION_RESTORE) == "true",
        paid=annotations.get(ANNOTATION_WARM_PAID) == "true",
    )
