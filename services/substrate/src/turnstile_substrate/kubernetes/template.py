"""Pod manifests: a sandbox pod, a warm-pool pod, and the label patch that adopts one.

Warm and cold pods of a tier are built by the same function from the same
settings (its runtime from ``tier_runtimes``, :mod:`.tier_runtime`), so they
differ only in name and labels (SPEC S2), and a claim hands out the runtime a
cold create would have made. The worker's sandbox id is not in its environment,
which never changes while a warm pod has none: it reads the pod's labels from a
downward-API file the kubelet rewrites after the adoption patch. With sandbox
credentials on (SPEC Z3) every pod, warm ones too (a volume cannot be added to a
running pod), mounts its ``<pod>-credential`` Secret as an optional volume; the
credential is never in the pod spec. Pods meet the restricted Pod Security
Standard and carry no service-account token.

The labels, the credential volume and the pod's security settings are described
in docs/substrate-kubernetes.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from typing import Any

from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_ORIGIN,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TEMPLATE,
    LABEL_TIER,
    MANAGED_BY,
    WORKER_NAME,
    RuntimeSpec,
)

#: Value of the pool label on warm pods.
POOL_WARM = "warm"
#: ``turnstile.dev/origin`` of every pod the warm pool made (kept once it is claimed).
ORIGIN_WARM_POOL = "warm-pool"
#: Annotation marking a pod created to restore a stopped sandbox's workspace.
ANNOTATION_RESTORE = "turnstile.dev/restore"
#: On a warm pod whose creation admission's ReserveWarm paid (a cluster-bucket token):
#: its claim gives the claim's own token back (SPEC W3). Kept by the adoption patch.
ANNOTATION_WARM_PAID = "turnstile.dev/warm-paid"

#: Where the downward-API volume of the pod's labels is mounted in the runtime container.
PODINFO_DIR = "/etc/turnstile/podinfo"
#: The labels file the worker reads its sandbox id from.
LABELS_FILE = f"{PODINFO_DIR}/labels"

#: Where the sandbox credential Secret is mounted, and the file the worker reads.
CREDENTIAL_DIR = "/etc/turnstile/credential"
CREDENTIAL_KEY = "credential"
CREDENTIAL_FILE = f"{CREDENTIAL_DIR}/{CREDENTIAL_KEY}"
#: Suffix of the per-pod credential Secret's name.
CREDENTIAL_SECRET_SUFFIX = "-credential"  # noqa: S105 - a name suffix, not a secret

#: Worker-agent variables the template sets (turnstile_affinity.worker.settings).
ENV_AFFINITY_ADDR = "TURNSTILE_AFFINITY_ADDR"
ENV_AFFINITY_SPIFFE_ID = "TURNSTILE_AFFINITY_SPIFFE_ID"
ENV_SANDBOX_ID_FILE = "TURNSTILE_WORKER_SANDBOX_ID_FILE"
ENV_TIER = "TURNSTILE_WORKER_TIER"
ENV_CAPACITY = "TURNSTILE_WORKER_CAPACITY"
ENV_CREDENTIAL_FILE = "TURNSTILE_WORKER_CREDENTIAL_FILE"

#: Where the sandbox-class certificate Secret is mounted (``worker_tls_secret``).
WORKER_TLS_DIR = "/etc/turnstile/tls"

#: Pod names stay within 63 characters so they are also valid hostnames.
_MAX_NAME = 63
_SUFFIX_LEN = 6
_NOT_DNS = re.compile(r"[^a-z0-9-]+")


def slug(value: str, max_len: int) -> str:
    """A DNS-label-safe fragment of ``value`` (lower case, ``[a-z0-9-]``, no edge dashes)."""
    cleaned = _NOT_DNS.sub("-", value.lower()).strip("-")
    return cleaned[:max_len].rstrip("-") or "x"


def _name(prefix: str, middle: str, suffix: str | None = None) -> str:
    suffix = suffix or secrets.token_hex(_SUFFIX_LEN // 2)
    room = _MAX_NAME - len(prefix) - len(suffix) - 2
    return f"{prefix}-{slug(middle, room)}-{suffix}"


def sandbox_pod_name(settings: KubernetesSettings, sandbox_id: str, generation: int = 0) -> str:
    """``<prefix>-<sandbox slug>-<hash>``: readable, and the same for every attempt at one
    activation (the hash of the sandbox id and its generation), so a retried or concurrent
    create of it gets ``AlreadyExists`` instead of making a second pod (SPEC F5). The hash
    keeps two sandboxes whose slugs collide (case, truncation) apart."""
    digest = hashlib.sha256(f"{sandbox_id}\x00{generation}".encode()).hexdigest()
    return _name(settings.name_prefix, sandbox_id, digest[:_SUFFIX_LEN])


def credential_secret_name(pod_name: str) -> str:
    """The Secret a pod mounts its sandbox credential from: fixed by the pod's name, because
    a warm pod's volumes are set before anyone knows which sandbox will claim it."""
    return pod_name + CREDENTIAL_SECRET_SUFFIX


def warm_pod_name(settings: KubernetesSettings, tier: str) -> str:
    return _name(settings.name_prefix, f"warm-{tier}")


def sandbox_labels(spec: RuntimeSpec) -> dict[str, str]:
    """The labels that make a pod the sandbox's (the client id only when not NULL)."""
    labels = {LABEL_SANDBOX_ID: spec.sandbox_id, LABEL_TIER: spec.tier}
    if spec.client_label is not None:
        labels[LABEL_CLIENT_ID] = spec.client_label
    return labels


def sandbox_pod(
    settings: KubernetesSettings, spec: RuntimeSpec, *, credentials: bool = False
) -> dict[str, Any]:
    """The manifest of a cold-created (or restored) sandbox pod."""
    annotations = {ANNOTATION_RESTORE: "true"} if spec.restore else {}
    return _pod(
        settings,
        name=sandbox_pod_name(settings, spec.sandbox_id, spec.generation),
        tier=spec.tier,
        labels=sandbox_labels(spec),
        annotations=annotations,
        credentials=credentials,
    )


def warm_pod(
    settings: KubernetesSettings, tier: str, *, credentials: bool = False
) -> dict[str, Any]:
    """The manifest of a warm-pool pod of ``tier``: no sandbox, no client."""
    labels = {
        LABEL_TIER: tier,
        LABEL_POOL: POOL_WARM,
        LABEL_ORIGIN: ORIGIN_WARM_POOL,
        LABEL_TEMPLATE: template_hash(settings, tier, credentials=credentials),
    }
    return _pod(
        settings,
        name=warm_pod_name(settings, tier),
        tier=tier,
        labels=labels,
        annotations={},
        credentials=credentials,
    )


def template_hash(settings: KubernetesSettings, tier: str, *, credentials: bool = False) -> str:
    """A hash of the pod spec ``tier``'s template gives (16 hex): equal for every pod the
    same settings make, different once anything in the spec changes (RuntimeClass,
    resources, image, ...). The spec is built for a fixed name, since a credential volume
    names its pod's Secret."""
    spec = _pod(
        settings, name="template", tier=tier, labels={}, annotations={}, credentials=credentials
    )["spec"]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def adoption_patch(spec: RuntimeSpec, resource_version: str) -> dict[str, Any]:
    """The strategic-merge patch that claims a warm pod for ``spec``.

    It carries the resourceVersion the claimer saw, so the API server applies it
    only to the pod as seen: of two concurrent claims one wins and the other gets
    409 Conflict. It adds the sandbox labels (the client id is set here, once)
    and removes the pool and template labels (``null`` deletes a key in a merge patch): the
    pod is then labelled as a cold pod of the sandbox is, plus its origin label.
    """
    labels: dict[str, str | None] = {
        **sandbox_labels(spec),
        LABEL_POOL: None,
        LABEL_TEMPLATE: None,
    }
    return {"metadata": {"resourceVersion": resource_version, "labels": labels}}


def worker_env(
    settings: KubernetesSettings, tier: str, *, credentials: bool = False
) -> list[dict[str, str]]:
    """The runtime container's environment: what the worker agent needs to attach.

    The tier is always set: the sandbox's tier as Activate resolved it (an empty
    request is the default tier), or the warm pool's, which adoption keeps. With
    no tiers configured it is empty and the worker sends no tier label (SPEC T1, T6).
    """
    env = {
        ENV_AFFINITY_ADDR: settings.affinity_addr,
        ENV_AFFINITY_SPIFFE_ID: settings.affinity_spiffe_id,
        ENV_SANDBOX_ID_FILE: LABELS_FILE,
        ENV_TIER: tier,
        ENV_CAPACITY: str(settings.worker_capacity),
    }
    if credentials:
        env[ENV_CREDENTIAL_FILE] = CREDENTIAL_FILE
    if settings.worker_tls_secret:
        env["TURNSTILE_WORKER_TLS_CERT_FILE"] = f"{WORKER_TLS_DIR}/tls.crt"
        env["TURNSTILE_WORKER_TLS_KEY_FILE"] = f"{WORKER_TLS_DIR}/tls.key"
        env["TURNSTILE_WORKER_TLS_CA_FILE"] = f"{WORKER_TLS_DIR}/ca.crt"
    return [{"name": name, "value": value} for name, value in env.items()]


def _pod(
    settings: KubernetesSettings,
    *,
    name: str,
    tier: str,
    labels: dict[str, str],
    annotations: dict[str, str],
    credentials: bool,
) -> dict[str, Any]:
    runtime = settings.tier_runtime(tier)
    resources = runtime.resources(settings)
    container: dict[str, Any] = {
        "name": settings.container_name,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": worker_env(settings, tier, credentials=credentials),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},  # noqa: S108 - the container's own emptyDir
        ],
    }
    if credentials:
        container["volumeMounts"].append(
            {"name": "credential", "mountPath": CREDENTIAL_DIR, "readOnly": True}
        )
    if resources:
        container["resources"] = resources
    tmp: dict[str, Any] = {"sizeLimit": settings.tmp_size_limit} if settings.tmp_size_limit else {}
    spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_group,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumes": [
            {
                "name": "podinfo",
                "downwardAPI": {
                    "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                },
            },
            {"name": "tmp", "emptyDir": tmp},
        ],
    }
    if credentials:
        spec["securityContext"]["fsGroup"] = settings.run_as_group
        spec["volumes"].append(
            {
                "name": "credential",
                "secret": {
                    "secretName": credential_secret_name(name),
                    "optional": True,
                    "defaultMode": 0o440,
                    "items": [{"key": CREDENTIAL_KEY, "path": CREDENTIAL_KEY}],
                },
            }
        )
    if settings.worker_tls_secret:
        container["volumeMounts"].append(
            {"name": "worker-tls", "mountPath": WORKER_TLS_DIR, "readOnly": True}
        )
        spec["volumes"].append(
            {
                "name": "worker-tls",
                "secret": {"secretName": settings.worker_tls_secret, "defaultMode": 0o444},
            }
        )
    if settings.service_account:
        spec["serviceAccountName"] = settings.service_account
    # The tier's runtime (a RuntimeClass) and the nodes that have it: cold and warm pods
    # alike, so a warm claim hands out what a cold create of the tier would have made.
    spec.update(runtime.scheduling())
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": settings.namespace,
        "labels": {
            **settings.extra_labels,
            **labels,
            LABEL_NAME: WORKER_NAME,
            LABEL_MANAGED_BY: MANAGED_BY,
        },
    }
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
