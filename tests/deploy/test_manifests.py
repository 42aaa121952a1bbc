"""The kustomizations build, validate against the Kubernetes API schema, and say
what production needs: replicas, probes, limits, security, disruption budgets,
autoscaling and least-privilege RBAC.

What this proves: the rendered objects are well-formed for Kubernetes 1.31 (the
oldest version targeted) and for the newest schema kubernetes-validate ships, with
unknown fields rejected, and they have the properties asserted below. What it
does not prove: admission by a real API server (defaulting, webhooks, Pod
Security admission itself), that the images exist, or that the services honour
the probe and environment conventions (docs/deploy.md lists them).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]

from .certmanager import CERT_MANAGER, validate_cert_manager
from .manifests import (
    KUSTOMIZATIONS,
    PORTS,
    REPO_ROOT,
    SERVICES,
    Obj,
    config_map,
    containers,
    env_value,
    named,
    of_kind,
    workloads,
)

Built = Callable[[str], list[Obj]]

OLDEST_KUBERNETES = "1.31.0"
"""The oldest Kubernetes the manifests target (unhealthyPodEvictionPolicy is GA)."""

KUBERNETES_VERSIONS = (OLDEST_KUBERNETES, str(latest_version()))

SUBSTRATE_POD_VERBS = {"create", "get", "list", "watch", "patch", "delete"}
#: Credential Secrets: written before a pod, renewed by replacement, listed by the
#: renewal pass, deleted with the runtime; never watched or patched.
SUBSTRATE_SECRET_VERBS = {"create", "get", "list", "update", "delete"}
RUNTIME_UID = 10001
"""The numeric user of the images (deploy/docker/service.Dockerfile)."""

HEALTH_PORT = 8081
"""The plaintext, health-only port kubelet probes (TURNSTILE_HEALTH_PORT)."""

HA_KUSTOMIZATIONS = ("base", "production")
"""Where every service runs at least three replicas (SPEC F1); dev runs one of each on a laptop."""


def _deployment(objects: list[Obj], service: str) -> Obj:
    return named(objects, "Deployment", f"turnstile-{service}")


def _container(objects: list[Obj], service: str) -> Obj:
    containers: list[Obj] = _deployment(objects, service)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{service}: one container per pod"
    return containers[0]


def _quantity(value: str | int | float) -> float:
    """A Kubernetes quantity (``250m``, ``1``, ``512Mi``) as a number."""
    text = str(value)
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 1e3, "M": 1e6, "G": 1e9}
    match = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", text)
    assert match, f"not a quantity: {text}"
    number, unit = match.groups()
    return float(number) * units.get(unit, 1.0)


def _validate(obj: Obj, version: str) -> None:
    if obj["apiVersion"].startswith(CERT_MANAGER):
        validate_cert_manager(obj)  # a CRD: kubernetes-validate has no schema for it
        return
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_kustomization_builds(built: Built, name: str) -> None:
    objects = built(name)
    assert objects
    namespaces = {o["metadata"].get("namespace", "turnstile") for o in objects}
    assert namespaces == {"turnstile", "turnstile-sandboxes", "cert-manager"}


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_object_validates_against_the_kubernetes_schema(
    built: Built, name: str, version: str
) -> None:
    failures = []
    for obj in built(name):
        try:
            _validate(obj, version)
        except jsonschema.ValidationError as exc:  # kubernetes-validate's is a subclass
            where = "/".join(str(p) for p in exc.path)
            failures.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_schema_validation_rejects_unknown_fields(built: Built) -> None:
    """Control: strict validation catches a misspelt field, so passing means something."""
    deployment: dict[str, Any] = dict(_deployment(built("base"), "admission"))
    deployment["spec"] = {**deployment["spec"], "replica": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, OLDEST_KUBERNETES)


@pytest.mark.parametrize("name", HA_KUSTOMIZATIONS)
def test_services_run_at_least_three_replicas_matching_their_autoscaler(
    built: Built, name: str
) -> None:
    objects = built(name)
    for service in SERVICES:
        replicas = _deployment(objects, service)["spec"]["replicas"]
        hpa = named(objects, "HorizontalPodAutoscaler", f"turnstile-{service}")["spec"]
        assert replicas >= 3, f"{service}: {replicas} replicas"
        assert hpa["minReplicas"] == replicas, "apply would fight the autoscaler otherwise"
        assert hpa["maxReplicas"] > hpa["minReplicas"]


def test_production_runs_as_many_replicas_and_more_resources_than_base(built: Built) -> None:
    base, production = built("base"), built("production")
    for service in SERVICES:
        assert (
            _deployment(production, service)["spec"]["replicas"]
            >= _deployment(base, service)["spec"]["replicas"]
        )
        for bound in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                prod = _container(production, service)["resources"][bound][resource]
                dev = _container(base, service)["resources"][bound][resource]
                assert _quantity(prod) >= _quantity(dev), (service, bound, resource)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_services_probe_grpc_health_natively(built: Built, name: str) -> None:
    objects = built(name)
    # Not the gRPC port: it wants a client certificate, and kubelet presents none.
    for service in PORTS:
        container = _container(objects, service)
        readiness, liveness = container["readinessProbe"], container["livenessProbe"]
        assert readiness["grpc"] == {"port": HEALTH_PORT}, "readiness follows overall health"
        assert liveness["grpc"] == {"port": HEALTH_PORT, "service": "liveness"}
        if service == "substrate":
            startup = container["startupProbe"]
            assert startup["grpc"] == {"port": HEALTH_PORT}
            budget = startup["periodSeconds"] * startup["failureThreshold"]
            assert budget >= 60, "the reflector's first list needs time on large clusters"
        else:
            assert "startupProbe" not in container


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_container_has_requests_within_limits(built: Built, name: str) -> None:
    for workload, template in workloads(built(name)):
        for container in containers(template):
            resources = container.get("resources", {})
            where = f"{workload['metadata']['name']}/{container['name']}"
            for resource in ("cpu", "memory"):
                request = resources.get("requests", {}).get(resource)
                limit = resources.get("limits", {}).get(resource)
                assert request is not None, f"{where}: no {resource} request"
                assert limit is not None, f"{where}: no {resource} limit"
                assert _quantity(request) <= _quantity(limit), where


@pytest.mark.parametrize("name", HA_KUSTOMIZATIONS)
def test_turnstile_pods_run_non_root_on_a_read_only_root(built: Built, name: str) -> None:
    for workload, template in workloads(built(name)):
        where = workload["metadata"]["name"]
        pod = template["spec"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True, where
        assert security["runAsUser"] == RUNTIME_UID, where
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, where
        tmp_volumes = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        for container in containers(template):
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts.get("/tmp") in tmp_volumes, f"{where}: /tmp must be an emptyDir"


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_pod_meets_the_restricted_pod_security_standard(built: Built, name: str) -> None:
    """The namespace enforces 'restricted', so a pod failing it would be refused."""
    objects = built(name)
    namespace = named(objects, "Namespace", "turnstile")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload, template in workloads(objects):
        where = workload["metadata"]["name"]
        pod = template["spec"]
        pod_ctx = pod.get("securityContext", {})
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
        assert not any("hostPath" in v for v in pod.get("volumes", [])), where
        seccomp = pod_ctx.get("seccompProfile", {}).get("type")
        for container in containers(template):
            ctx = container.get("securityContext", {})
            assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, where
            assert ctx.get("runAsUser", pod_ctx.get("runAsUser")) != 0, where
            assert ctx.get("allowPrivilegeEscalation") is False, where
            assert not ctx.get("privileged"), where
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not ctx.get("capabilities", {}).get("add"), where
            assert ctx.get("seccompProfile", {}).get("type", seccomp) == "RuntimeDefault", where


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_each_service_has_a_disruption_budget_and_a_cpu_autoscaler(built: Built, name: str) -> None:
    objects = built(name)
    for service in SERVICES:
        deployment = _deployment(objects, service)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        pdb = named(objects, "PodDisruptionBudget", f"turnstile-{service}")["spec"]
        selector = pdb["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), f"{service}: PDB selects no pods"
        assert pdb.get("maxUnavailable") == 1, "one pod at a time, at any replica count"

        hpa = named(objects, "HorizontalPodAutoscaler", f"turnstile-{service}")
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", f"turnstile-{service}")
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Resource"
        assert metric["resource"]["name"] == "cpu"
        assert metric["resource"]["target"]["type"] == "Utilization"


@pytest.mark.parametrize("name", HA_KUSTOMIZATIONS)
def test_replicas_spread_across_nodes_and_zones(built: Built, name: str) -> None:
    objects = built(name)
    for service in SERVICES:
        template = _deployment(objects, service)["spec"]["template"]
        labels = template["metadata"]["labels"]
        constraints = {c["topologyKey"]: c for c in template["spec"]["topologySpreadConstraints"]}
        assert constraints["kubernetes.io/hostname"]["whenUnsatisfiable"] == "DoNotSchedule"
        assert "topology.kubernetes.io/zone" in constraints
        for constraint in constraints.values():
            assert constraint["labelSelector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_substrate_may_only_manage_sandbox_pods_their_secrets_and_its_lease(
    built: Built, name: str
) -> None:
    """Pods and Secrets in the sandboxes' namespace alone, its Lease in its own
    (SPEC O4): no Secret right in Turnstile's namespace, none cluster-wide."""
    objects = built(name)
    assert not of_kind(objects, "ClusterRole")
    assert not of_kind(objects, "ClusterRoleBinding")
    roles = {r["metadata"]["name"]: r for r in of_kind(objects, "Role")}
    assert set(roles) == {"turnstile-substrate", "turnstile-substrate-leader"}
    sandboxes, leader = roles["turnstile-substrate"], roles["turnstile-substrate-leader"]
    assert sandboxes["metadata"]["namespace"] == "turnstile-sandboxes"
    rule, secret_rule = sandboxes["rules"]
    assert rule["apiGroups"] == [""]
    assert rule["resources"] == ["pods"], "no subresources (exec, log, status), no other kinds"
    assert set(rule["verbs"]) == SUBSTRATE_POD_VERBS
    assert "resourceNames" not in rule
    assert secret_rule["apiGroups"] == [""]
    assert secret_rule["resources"] == ["secrets"]
    assert set(secret_rule["verbs"]) == SUBSTRATE_SECRET_VERBS
    # Leader election, in its own namespace: read, create and renew (an optimistic
    # update) the Lease; no delete.
    assert leader["metadata"]["namespace"] == "turnstile"
    (lease_rule,) = leader["rules"]
    assert lease_rule["apiGroups"] == ["coordination.k8s.io"]
    assert lease_rule["resources"] == ["leases"]
    assert set(lease_rule["verbs"]) == {"get", "create", "update"}

    bindings = {b["metadata"]["name"]: b for b in of_kind(objects, "RoleBinding")}
    assert set(bindings) == set(roles)
    for role_name, binding in bindings.items():
        assert binding["metadata"]["namespace"] == roles[role_name]["metadata"]["namespace"]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role_name,
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "turnstile-substrate", "namespace": "turnstile"}
        ]
    for workload, template in workloads(objects):
        pod = template["spec"]
        if workload["metadata"]["name"] == "turnstile-substrate":
            assert pod["serviceAccountName"] == "turnstile-substrate"
            assert pod["automountServiceAccountToken"] is True
            lease_env = next(
                e
                for e in pod["containers"][0]["env"]
                if e["name"] == "TURNSTILE_K8S_LEADER_LEASE_NAMESPACE"
            )
            assert lease_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
        else:
            where = workload["metadata"]["name"]
            assert pod.get("serviceAccountName") != "turnstile-substrate", where
            assert pod.get("automountServiceAccountToken") is False, f"{where} gets no token"


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", ())}


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_workers_must_attest_with_keys_mounted_from_a_secret_and_a_config_map(
    built: Built, name: str
) -> None:
    objects = built(name)
    pods = {w["metadata"]["name"]: t["spec"] for w, t in workloads(objects)}
    affinity, substrate = pods["turnstile-affinity"], pods["turnstile-substrate"]
    affinity_env = _env(affinity["containers"][0])
    assert affinity_env["TURNSTILE_WORKER_ATTESTATION"] == "enforce"
    keys_volume = next(v for v in affinity["volumes"] if "configMap" in v)
    assert keys_volume["configMap"]["name"].startswith("turnstile-worker-credential-public-keys")
    mount = next(
        m for m in affinity["containers"][0]["volumeMounts"] if m["name"] == keys_volume["name"]
    )
    assert affinity_env["TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE"].startswith(
        mount["mountPath"] + "/"
    )
    substrate_env = _env(substrate["containers"][0])
    key_volume = next(v for v in substrate["volumes"] if "secret" in v)
    assert key_volume["secret"]["secretName"].startswith("turnstile-worker-credential-signing-key")
    mount = next(
        m for m in substrate["containers"][0]["volumeMounts"] if m["name"] == key_volume["name"]
    )
    assert substrate_env["TURNSTILE_WORKER_CREDENTIAL_SIGNING_KEY_FILE"].startswith(
        mount["mountPath"] + "/"
    )
    assert substrate["securityContext"]["fsGroup"] == substrate["securityContext"]["runAsGroup"]
    generated = {s["metadata"]["name"] for s in of_kind(objects, "Secret")}
    if name == "dev":
        assert any(n.startswith("turnstile-worker-credential-signing-key") for n in generated)
    else:
        # Production's signing key is made outside this repository, never a literal here.
        assert not any("signing-key" in n for n in generated)


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_services_listen_where_their_peers_and_services_point(built: Built, name: str) -> None:
    objects = built(name)
    config = config_map(objects, "turnstile-config")
    settings = config["data"]
    for service, (grpc_port, metrics_port) in PORTS.items():
        container = _container(objects, service)
        assert container["command"] == [f"turnstile-{service}"]
        assert env_value(container, "TURNSTILE_PORT") == str(grpc_port)
        assert env_value(container, "TURNSTILE_METRICS_PORT") == str(metrics_port)
        assert env_value(container, "OTEL_SERVICE_NAME") == f"turnstile-{service}"
        assert {"configMapRef": {"name": config["metadata"]["name"]}} in container["envFrom"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": grpc_port, "metrics": metrics_port, "health": HEALTH_PORT}

        svc = named(objects, "Service", f"turnstile-{service}")
        labels = _deployment(objects, service)["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items()
        assert {(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
            (grpc_port, "grpc"),
            (metrics_port, "metrics"),
        }
        addr = settings[f"TURNSTILE_{service.upper()}_ADDR"]
        assert addr == f"{svc['metadata']['name']}:{grpc_port}"

    assert settings["TURNSTILE_HOST"] == "0.0.0.0"  # noqa: S104  (containers listen on all)
    assert settings["TURNSTILE_LOG_FORMAT"] == "json"
    assert 0 < float(settings["TURNSTILE_SHUTDOWN_DRAIN_DELAY_S"]) < 30
    assert settings["TURNSTILE_REDIS_URL"].startswith(("redis://", "rediss://"))
    assert settings["TURNSTILE_HEALTH_PORT"] == str(HEALTH_PORT)
    assert settings["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4317")


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_substrate_alone_reads_the_kubernetes_substrate_settings(built: Built, name: str) -> None:
    """Resizing the warm pool rolls substrate only; the other services never see it."""
    objects = built(name)
    substrate_config = config_map(objects, "turnstile-substrate-config")
    reference = {"configMapRef": {"name": substrate_config["metadata"]["name"]}}
    assert substrate_config["data"]["TURNSTILE_SUBSTRATE_KIND"] == "kubernetes"
    assert json.loads(substrate_config["data"]["TURNSTILE_K8S_TIER_RUNTIMES"])
    for workload, template in workloads(objects):
        for container in containers(template):
            reads = reference in container.get("envFrom", [])
            assert reads == (workload["metadata"]["name"] == "turnstile-substrate"), workload
    shared = config_map(objects, "turnstile-config")["data"]
    assert not [k for k in shared if k.startswith("TURNSTILE_K8S_")], "substrate's own settings"


def test_production_samples_one_trace_in_ten_as_the_admission_benchmark_does(
    built: Built,
) -> None:
    """The admission benchmark measures with the production sampler: they must agree."""
    settings = config_map(built("production"), "turnstile-config")["data"]
    assert settings["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert settings["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    bench = (REPO_ROOT / "services/admission/bench/bench_admit.py").read_text()
    assert 'PRODUCTION_SAMPLER, PRODUCTION_SAMPLER_ARG = "parentbased_traceidratio", "0.1"' in bench


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_database_url_comes_from_a_secret(built: Built, name: str) -> None:
    objects = built(name)
    for workload, template in workloads(objects):
        for container in containers(template):
            for var in container.get("env", []):
                if var["name"] == "TURNSTILE_DATABASE_URL":
                    assert "value" not in var, f"{workload['metadata']['name']}: inline secret"
                    assert var["valueFrom"]["secretKeyRef"]["key"] == "url"
    substrate = _container(objects, "substrate")
    assert any(v["name"] == "TURNSTILE_DATABASE_URL" for v in substrate["env"])


def test_dev_stack_points_turnstile_at_its_own_stores(built: Built) -> None:
    objects = built("dev")
    config = config_map(objects, "turnstile-config")
    assert config["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert config["data"]["TURNSTILE_REDIS_URL"] == "redis://redis:6379/0"
    jaeger = named(objects, "Deployment", "jaeger")["spec"]["template"]["spec"]["containers"][0]
    assert jaeger["image"].startswith("jaegertracing/jaeger:2.")
    assert {p["containerPort"] for p in jaeger["ports"]} == {4317, 4318, 16686}
    assert {p["port"] for p in named(objects, "Service", "jaeger")["spec"]["ports"]} == {
        4317,
        4318,
        16686,
    }
    secret = next(s for s in of_kind(objects, "Secret") if "url" in s.get("data", {}))
    url = base64.b64decode(secret["data"]["url"]).decode()
    assert url.startswith("postgresql://")
    assert "@postgresql:5432/" in url
    named(objects, "Service", "postgresql")
    named(objects, "Service", "redis")


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_migration_job_runs_turnstile_migrate_once(built: Built, name: str) -> None:
    objects = built(name)
    job = named(objects, "Job", "turnstile-migrate")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["turnstile-migrate"]
    assert pod["restartPolicy"] == "Never"
    assert 0 < job["spec"]["backoffLimit"] <= 10
    assert job["spec"]["activeDeadlineSeconds"] > 0
    assert any(v["name"] == "TURNSTILE_DATABASE_URL" for v in container["env"])


def test_production_pins_every_image_to_one_release(built: Built) -> None:
    objects = built("production")
    images = {c["image"] for _, t in workloads(objects) for c in containers(t)}
    sandbox = env_value(_container(objects, "substrate"), "TURNSTILE_K8S_IMAGE")
    assert sandbox is not None
    tags = set()
    for image in [*images, sandbox]:
        name, _, tag = image.rpartition(":")
        assert "/" in name, f"{image}: production images come from a registry"
        assert tag, f"{image}: no tag"
        assert tag != "latest", image
        tags.add(tag)
    assert len(tags) == 1, f"images from different releases: {sorted(images | {sandbox})}"
    job_image = named(objects, "Job", "turnstile-migrate")["spec"]["template"]["spec"][
        "containers"
    ][0]["image"]
    assert job_image == _container(objects, "substrate")["image"], "migrate ships in substrate"
    for _, template in workloads(objects):
        for container in containers(template):
            assert container.get("imagePullPolicy") == "IfNotPresent"
