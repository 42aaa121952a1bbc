"""The manifests speak the services' settings: every ``TURNSTILE_*`` variable they set is
one some settings class reads, each container's environment builds its process's
settings, and the sandbox pods the substrate would create from the deployed settings
run a worker that may reach the relay, under the namespace's Pod Security Standard.

A renamed setting fails here instead of being silently ignored (``extra="ignore"``).
What this does not prove: that a real kubelet starts these pods, or that the
relay address resolves in the cluster's DNS.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]
from pydantic_settings import BaseSettings

from turnstile_admission.settings import AdmissionSettings
from turnstile_affinity.settings import AffinitySettings
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.template import sandbox_pod, warm_pod
from turnstile_substrate.runtime import RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator.podsecurity import restricted_violations

from .conftest import TILTFILE
from .manifests import KUSTOMIZATIONS, Obj, containers, named, of_kind, workloads
from .netpol import Endpoint, allowed, selecting
from .settings_env import container_env, read_variables, turnstile_names, variables_of
from .tiltfile import TiltState

Built = Callable[[str], list[Obj]]
S = TypeVar("S", bound=BaseSettings)

#: The settings classes each workload's process builds from its environment.
PROCESS_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {
    "turnstile-admission": (AdmissionSettings,),
    "turnstile-substrate": (SubstrateSettings, KubernetesSettings),
    "turnstile-affinity": (AffinitySettings,),
    "turnstile-migrate": (SubstrateSettings,),
}

READ = read_variables()


def _set_variables(objects: list[Obj]) -> Iterator[tuple[str, str]]:
    """(where, name) of every TURNSTILE_* variable a ConfigMap or a container sets."""
    for config in of_kind(objects, "ConfigMap"):
        for name in turnstile_names(config.get("data") or {}):
            yield f"ConfigMap/{config['metadata']['name']}", name
    for workload, template in workloads(objects):
        for container in containers(template):
            for var in container.get("env", []):
                if var["name"].startswith("TURNSTILE_"):
                    yield f"{workload['metadata']['name']}/{container['name']}", var["name"]


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Exactly ``env`` as the process's TURNSTILE_* environment, restored afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("TURNSTILE_")}
    try:
        for name in saved:
            del os.environ[name]
        os.environ.update({k: v for k, v in env.items() if k.startswith("TURNSTILE_")})
        yield
    finally:
        for name in [k for k in os.environ if k.startswith("TURNSTILE_")]:
            del os.environ[name]
        os.environ.update(saved)


def _build(cls: type[S], env: dict[str, str]) -> S:
    with _environment(env):
        return cls()


def _workload_env(objects: list[Obj], name: str) -> dict[str, str]:
    for workload, template in workloads(objects):
        if workload["metadata"]["name"] == name:
            (container,) = template["spec"]["containers"]
            return container_env(objects, workload, container)
    raise AssertionError(f"no workload {name}")


def _deployed_k8s(objects: list[Obj]) -> KubernetesSettings:
    return _build(KubernetesSettings, _workload_env(objects, "turnstile-substrate"))


# ---------------------------------------------------------------------- names


def test_the_walker_reads_aliases_and_nested_policies_and_misses_stale_names() -> None:
    """Control: the set the checks below compare against is the real one."""
    assert {
        "TURNSTILE_PORT",
        "TURNSTILE_TIERS",
        "TURNSTILE_DEFAULT_TIER",
        "TURNSTILE_CAP__MODE",
        "TURNSTILE_SLOTS__PER_NODE",
        "TURNSTILE_K8S_IMAGE",
        "TURNSTILE_K8S_TIER_RUNTIMES",
        "TURNSTILE_K8S_AFFINITY_ADDR",
        "TURNSTILE_AFFINITY_ADDR",
        "TURNSTILE_WORKER_SANDBOX_ID_FILE",
        "TURNSTILE_LOG_FORMAT",
    } <= READ
    for stale in ("TURNSTILE_SANDBOX_IMAGE", "TURNSTILE_WARM_POOL_SIZE", "TURNSTILE_CAP_MODE"):
        assert stale not in READ
    assert "TURNSTILE_K8S_AFFINITY_ADDR" in variables_of(KubernetesSettings)
    assert "TURNSTILE_AFFINITY_ADDR" in variables_of(KubernetesSettings)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_turnstile_variable_the_manifests_set_is_read_by_a_settings_class(
    built: Built, name: str
) -> None:
    unknown = sorted(
        {f"{where}: {var}" for where, var in _set_variables(built(name)) if var not in READ}
    )
    assert unknown == [], "set but read by nothing (renamed?)"


def test_every_turnstile_variable_the_tiltfile_sets_or_names_is_read(
    tilt: TiltState, tilt_objects: list[Obj]
) -> None:
    named_in_text = set(re.findall(r"\bTURNSTILE_[A-Z0-9_]*[A-Z0-9]\b", TILTFILE.read_text()))
    set_in_objects = {var for _, var in _set_variables(tilt_objects)}
    assert set_in_objects, "the Tiltfile deploys objects with settings"
    assert sorted((named_in_text | set_in_objects) - READ) == []


# ---------------------------------------------------------------------- values


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_each_containers_environment_builds_its_processes_settings(built: Built, name: str) -> None:
    objects = built(name)
    seen = set()
    for workload, template in workloads(objects):
        classes = PROCESS_SETTINGS.get(workload["metadata"]["name"])
        if classes is None:
            continue  # the dev stack's Redis, PostgreSQL, Jaeger
        seen.add(workload["metadata"]["name"])
        (container,) = template["spec"]["containers"]
        env = container_env(objects, workload, container)
        for cls in classes:
            _build(cls, env)  # raises, naming the variable, on a bad value
    assert seen == set(PROCESS_SETTINGS)

    substrate = _build(SubstrateSettings, _workload_env(objects, "turnstile-substrate"))
    assert substrate.substrate_kind == "kubernetes"
    k8s = _deployed_k8s(objects)
    assert k8s.namespace == "turnstile-sandboxes", "sandbox pods go where substrate's Role applies"
    roles = {r["metadata"]["name"]: r["metadata"]["namespace"] for r in of_kind(objects, "Role")}
    assert roles["turnstile-substrate"] == k8s.namespace
    assert k8s.leader_lease_namespace == roles["turnstile-substrate-leader"] == "turnstile"
    assert k8s.image.rpartition("/")[2].startswith("turnstile-worker")
    assert sum(runtime.warm_pool_size for runtime in k8s.tier_runtimes.values()) >= 1


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_substrate_and_affinity_read_the_same_tiers_and_tier_runtimes_are_declared_tiers(
    built: Built, name: str
) -> None:
    objects = built(name)
    substrate = _build(SubstrateSettings, _workload_env(objects, "turnstile-substrate"))
    affinity = _build(AffinitySettings, _workload_env(objects, "turnstile-affinity"))
    assert substrate.tier_config.enabled
    assert substrate.tier_config == affinity.tier_config
    declared = set(substrate.tier_config.declared)
    assert set(_deployed_k8s(objects).tier_runtimes) <= declared


# ---------------------------------------------------------------------- sandbox pods


def _pod_labels(objects: list[Obj], deployment: str) -> dict[str, str]:
    labels: dict[str, str] = named(objects, "Deployment", deployment)["spec"]["template"][
        "metadata"
    ]["labels"]
    return labels


def _sandbox_pods(objects: list[Obj]) -> dict[str, dict[str, Any]]:
    """A cold and a warm pod of every declared tier, as the deployed substrate makes them."""
    k8s = _deployed_k8s(objects)
    tiers = _build(SubstrateSettings, _workload_env(objects, "turnstile-substrate")).tier_config
    pods = {}
    for tier in tiers.declared:
        spec = RuntimeSpec(sandbox_id="sb-1", tier=tier, client_label="acme")
        # The deployed substrate has a signing key, so its pods mount the credential Secret.
        pods[f"cold {tier}"] = sandbox_pod(k8s, spec, credentials=True)
        pods[f"warm {tier}"] = warm_pod(k8s, tier, credentials=True)
    return pods


@pytest.mark.parametrize("version", ["1.31.0", str(latest_version())])
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_sandbox_pods_from_the_deployed_settings_validate(
    built: Built, name: str, version: str
) -> None:
    for pod in _sandbox_pods(built(name)).values():
        kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_sandbox_pods_meet_the_namespaces_restricted_pod_security_standard(
    built: Built, name: str
) -> None:
    objects = built(name)
    namespace = named(objects, "Namespace", "turnstile-sandboxes")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for kind, pod in _sandbox_pods(objects).items():
        spec = pod["spec"]
        assert restricted_violations(pod) == [], kind  # the emulator's admission checks
        assert pod["metadata"]["namespace"] == namespace["metadata"]["name"], kind
        pod_ctx = spec["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True, kind
        assert pod_ctx["runAsUser"] != 0, kind
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}, kind
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), kind
        assert not any("hostPath" in v for v in spec["volumes"]), kind
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, kind
            assert ctx["capabilities"] == {"drop": ["ALL"]}, kind
            assert not ctx.get("privileged"), kind
            assert ctx["readOnlyRootFilesystem"] is True, kind
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}, kind


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_sandbox_pods_workers_reach_the_relay_and_nothing_else_of_turnstile(
    built: Built, name: str
) -> None:
    objects = built(name)
    policies = of_kind(objects, "NetworkPolicy")
    service = named(objects, "Service", "turnstile-affinity")
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    relay_service = named(objects, "Service", "turnstile-affinity-relay")
    assert relay_service["spec"]["clusterIP"] == "None"
    assert relay_service["spec"]["selector"] == service["spec"]["selector"]
    namespace = relay_service["metadata"]["namespace"]
    relay = Endpoint("affinity", _pod_labels(objects, "turnstile-affinity"))
    others = [
        (Endpoint(other, _pod_labels(objects, f"turnstile-{other}")), port)
        for other, port in (("substrate", 50052), ("admission", 50051))
    ]
    for kind, pod in _sandbox_pods(objects).items():
        worker = Endpoint(
            f"{kind} sandbox pod", pod["metadata"]["labels"], pod["metadata"]["namespace"]
        )
        assert selecting(policies, worker.labels), f"{kind}: no policy isolates sandbox pods"
        assert allowed(policies, worker, relay, grpc["port"]), kind
        for other, port in others:
            assert not allowed(policies, worker, other, port), f"{kind} -> {other.name}"

        (container,) = pod["spec"]["containers"]
        env = {var["name"]: var["value"] for var in container["env"]}
        # Through the headless Service: each worker picks a replica among its addresses.
        assert env["TURNSTILE_AFFINITY_ADDR"] == (
            f"dns:///{relay_service['metadata']['name']}.{namespace}.svc.cluster.local:"
            f"{grpc['port']}"
        )
        assert set(turnstile_names(env)) <= variables_of(WorkerSettings)
        worker_settings = _build(WorkerSettings, env)
        assert worker_settings.sandbox_id is None, "warm pods learn it from their labels"
        assert worker_settings.sandbox_id_file is not None
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert str(worker_settings.sandbox_id_file.parent) in mounts


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_each_tiers_pods_name_a_runtime_class_the_manifests_ship(built: Built, name: str) -> None:
    objects = built(name)
    shipped = {rc["metadata"]["name"]: rc for rc in of_kind(objects, "RuntimeClass")}
    pods = _sandbox_pods(objects)
    for kind, pod in pods.items():
        runtime_class = pod["spec"].get("runtimeClassName")
        assert runtime_class is None or runtime_class in shipped, f"{kind}: {runtime_class}"
    if name == "dev":
        # laptop clusters have no Kata: every tier runs the default runtime there
        assert all("runtimeClassName" not in pod["spec"] for pod in pods.values())
        return
    for kind in ("cold", "warm"):
        assert pods[f"{kind} microvm"]["spec"]["runtimeClassName"] == "kata"
        assert "runtimeClassName" not in pods[f"{kind} container"]["spec"]
    assert shipped["kata"]["handler"] == "kata"
    assert _deployed_k8s(objects).warm_size("microvm") >= 1
