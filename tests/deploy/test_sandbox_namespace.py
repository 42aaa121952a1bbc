"""Sandbox pods run in a namespace that holds no Turnstile secret but their own
credentials, and the CA key lives outside it (SPEC O4).

Sandbox pods run untrusted code. Whatever one reaches by escaping its sandbox (the
node's view of the namespace, a mounted token, a Role bound too widely), the
namespace it runs in must hold nothing of Turnstile's: no signing key, no database
or Redis credential, no service key, no CA key. The only Secrets there are the
per-pod credential Secrets substrate writes at run time and the sandbox-class
certificate every sandbox pod mounts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.template import (
    CREDENTIAL_SECRET_SUFFIX,
    sandbox_pod,
    warm_pod,
)
from turnstile_substrate.runtime import RuntimeSpec

from .manifests import KUSTOMIZATIONS, Obj, config_map, named, of_kind, workloads
from .settings_env import build_settings, container_env

Built = Callable[[str], list[Obj]]

SANDBOXES = "turnstile-sandboxes"
TURNSTILE = "turnstile"
#: The one Secret of the sandboxes' namespace the manifests make (the others, one
#: per pod, substrate writes at run time).
SANDBOX_TLS = "turnstile-sandbox-tls"


def _namespace(obj: Obj) -> str:
    namespace: str = obj["metadata"].get("namespace", "")
    return namespace


def _secrets_in(objects: list[Obj], namespace: str) -> set[str]:
    """The Secrets a kustomization puts in ``namespace``: Secret objects, and the
    Secrets cert-manager writes for its Certificates."""
    secrets = {
        s["metadata"]["name"] for s in of_kind(objects, "Secret") if _namespace(s) == namespace
    }
    issued = {
        c["spec"]["secretName"]
        for c in of_kind(objects, "Certificate")
        if _namespace(c) == namespace
    }
    return secrets | issued


def _deployed(objects: list[Obj]) -> KubernetesSettings:
    substrate = named(objects, "Deployment", "turnstile-substrate")
    (container,) = substrate["spec"]["template"]["spec"]["containers"]
    return build_settings(KubernetesSettings, container_env(objects, substrate, container))


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_sandbox_pods_go_to_a_namespace_of_their_own(built: Built, name: str) -> None:
    objects = built(name)
    settings = _deployed(objects)
    assert settings.namespace == SANDBOXES
    assert named(objects, "Namespace", SANDBOXES)
    for workload, _ in workloads(objects):
        assert _namespace(workload) != SANDBOXES, "no Turnstile workload runs beside sandboxes"


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_the_sandboxes_namespace_holds_no_secret_but_the_sandbox_certificate(
    built: Built, name: str
) -> None:
    objects = built(name)
    assert _secrets_in(objects, SANDBOXES) == {SANDBOX_TLS}
    assert (
        config_map(objects, "turnstile-substrate-config")["data"]["TURNSTILE_K8S_WORKER_TLS_SECRET"]
        == SANDBOX_TLS
    )


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_the_ca_key_lives_outside_turnstiles_and_the_sandboxes_namespaces(
    built: Built, name: str
) -> None:
    objects = built(name)
    (ca,) = [c for c in of_kind(objects, "Certificate") if c["spec"].get("isCA")]
    assert _namespace(ca) == "cert-manager"  # the ClusterIssuers' resource namespace
    for issuer in of_kind(objects, "ClusterIssuer"):
        assert "namespace" not in issuer["metadata"], "a ClusterIssuer is cluster-scoped"
        if "ca" in issuer["spec"]:
            assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"]
    assert not of_kind(objects, "Issuer"), "a namespaced CA issuer would need the key beside it"
    for namespace in (TURNSTILE, SANDBOXES):
        assert ca["spec"]["secretName"] not in _secrets_in(objects, namespace)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_turnstiles_own_secrets_stay_in_turnstiles_namespace(built: Built, name: str) -> None:
    """The signing key and the data stores' credentials: mounted by substrate from its
    own namespace, never in the sandboxes'."""
    objects = built(name)
    substrate = named(objects, "Deployment", "turnstile-substrate")
    assert _namespace(substrate) == TURNSTILE
    spec = substrate["spec"]["template"]["spec"]
    mounted = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    referenced = {
        source["secretKeyRef"]["name"]
        for env in spec["containers"][0].get("env", [])
        if (source := env.get("valueFrom", {})).get("secretKeyRef")
    }
    assert mounted | referenced, "substrate reads its key and credentials from Secrets"
    for secret in mounted | referenced:
        assert secret not in _secrets_in(objects, SANDBOXES), secret
    # The dev overlay's generated Secrets (dev database, dev signing key) are Turnstile's.
    for secret in of_kind(objects, "Secret"):
        assert _namespace(secret) == TURNSTILE, secret["metadata"]["name"]


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_sandbox_pods_mount_only_their_credential_and_the_sandbox_certificate(
    built: Built, name: str
) -> None:
    settings = _deployed(built(name))
    spec = RuntimeSpec(sandbox_id="sb-1", tier="", client_label="acme")
    pods: dict[str, dict[str, Any]] = {
        "cold": sandbox_pod(settings, spec, credentials=True),
        "warm": warm_pod(settings, next(iter(settings.tier_runtimes)), credentials=True),
    }
    for kind, pod in pods.items():
        assert pod["metadata"]["namespace"] == SANDBOXES, kind
        secrets = {v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v}
        pod_name = pod["metadata"]["name"]
        assert secrets == {SANDBOX_TLS, f"{pod_name}{CREDENTIAL_SECRET_SUFFIX}"}, kind
        assert pod["spec"]["automountServiceAccountToken"] is False, kind
