"""Pod manifests: a sandbox pod, a warm-pool pod, and the label patch that adopts one.

Labels (SPEC S2, DESIGN "Kubernetes"):

* ``turnstile.dev/sandbox-id`` — the sandbox the pod runs; absent on a warm pod;
* ``turnstile.dev/client-id`` — the record value of the activating client, set
  when the pod becomes the sandbox's (at create, or by the adoption patch of a
  warm pod, which never has one) and never changed after; absent when the
  record is NULL (an inheriting activation of an unattributed sandbox);
* ``turnstile.dev/tier`` — the tier;
* ``turnstile.dev/pool`` — only on unclaimed warm pods; the adoption patch removes it;
* ``app.kubernetes.io/managed-by: turnstile`` — what the reflector selects.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    MANAGED_BY,
    RuntimeSpec,
)

#: Value of the pool label on warm pods.
POOL_WARM = "warm"
#: Annotation marking a pod created to restore a stopped sandbox's workspace.
ANNOTATION_RESTORE = "turnstile.dev/restore"

#: Pod names stay within 63 characters so they are also valid hostnames.
_MAX_NAME = 63
_SUFFIX_LEN = 6
_NOT_DNS = re.compile(r"[^a-z0-9-]+")


def slug(value: str, max_len: int) -> str:
    """A DNS-label-safe fragment of ``value`` (lower case, ``[a-z0-9-]``, no edge dashes)."""
    cleaned = _NOT_DNS.sub("-", value.lower()).strip("-")
    return cleaned[:max_len].rstrip("-") or "x"


def _name(prefix: str, middle: str) -> str:
    suffix = secrets.token_hex(_SUFFIX_LEN // 2)
    room = _MAX_NAME - len(prefix) - len(suffix) - 2
    return f"{prefix}-{slug(middle, room)}-{suffix}"


def sandbox_pod_name(settings: KubernetesSettings, sandbox_id: str) -> str:
    """``<prefix>-<sandbox slug>-<random>``: readable, unique per create."""
    return _name(settings.name_prefix, sandbox_id)


def warm_pod_name(settings: KubernetesSettings, tier: str) -> str:
    return _name(settings.name_prefix, f"warm-{tier}")


def sandbox_labels(spec: RuntimeSpec) -> dict[str, str]:
    """The labels that make a pod the sandbox's (the client id only when not NULL)."""
    labels = {LABEL_SANDBOX_ID: spec.sandbox_id, LABEL_TIER: spec.tier}
    if spec.client_label is not None:
        labels[LABEL_CLIENT_ID] = spec.client_label
    return labels


def sandbox_pod(settings: KubernetesSettings, spec: RuntimeSpec) -> dict[str, Any]:
    """The manifest of a cold-created (or restored) sandbox pod."""
    annotations = {ANNOTATION_RESTORE: "true"} if spec.restore else {}
    return _pod(
        settings,
        name=sandbox_pod_name(settings, spec.sandbox_id),
        labels=sandbox_labels(spec),
        annotations=annotations,
    )


def warm_pod(settings: KubernetesSettings, tier: str) -> dict[str, Any]:
    """The manifest of a warm-pool pod of ``tier``: no sandbox, no client."""
    return _pod(
        settings,
        name=warm_pod_name(settings, tier),
        labels={LABEL_TIER: tier, LABEL_POOL: POOL_WARM},
        annotations={},
    )


def adoption_patch(spec: RuntimeSpec, resource_version: str) -> dict[str, Any]:
    """The strategic-merge patch that claims a warm pod for ``spec``.

    It carries the resourceVersion the claimer saw, so the API server applies it
    only to the pod as seen: of two concurrent claims one wins and the other gets
    409 Conflict. It adds the sandbox labels (the client id is set here, once)
    and removes the pool label (``null`` deletes a key in a merge patch).
    """
    labels: dict[str, str | None] = {**sandbox_labels(spec), LABEL_POOL: None}
    return {"metadata": {"resourceVersion": resource_version, "labels": labels}}


def _pod(
    settings: KubernetesSettings,
    *,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str],
) -> dict[str, Any]:
    requests = _quantities(cpu=settings.cpu_request, memory=settings.memory_request)
    limits = _quantities(cpu=settings.cpu_limit, memory=settings.memory_limit)
    container: dict[str, Any] = {
        "name": settings.container_name,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
    }
    if requests or limits:
        container["resources"] = {
            part: values for part, values in (("requests", requests), ("limits", limits)) if values
        }
    spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.termination_grace_s,
    }
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": settings.namespace,
        "labels": {**settings.extra_labels, **labels, LABEL_MANAGED_BY: MANAGED_BY},
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _quantities(**values: str) -> dict[str, str]:
    return {name: value for name, value in values.items() if value}
