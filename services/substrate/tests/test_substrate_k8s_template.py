"""Pod manifests (pure functions): the worker's environment and labels file, the labels
the NetworkPolicies select, the restricted Pod Security Standard, resources from settings."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from kubernetes_validate.utils import latest_version  # type: ignore[import-untyped]
from pydantic import ValidationError

from turnstile_substrate.kubernetes import KubernetesSettings
from turnstile_substrate.kubernetes.template import (
    PODINFO_DIR,
    adoption_patch,
    sandbox_pod,
    template_hash,
    warm_pod,
)
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
from turnstile_testing.kube_emulator.podsecurity import restricted_violations

SPEC = RuntimeSpec(sandbox_id="sb-1", tier="container", client_label="acme")


def settings(**values: Any) -> KubernetesSettings:
    return KubernetesSettings(**{"affinity_addr": "turnstile-affinity:50053", **values})


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    [container] = pod["spec"]["containers"]
    return {var["name"]: var["value"] for var in container["env"]}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TURNSTILE_AFFINITY_ADDR", "TURNSTILE_K8S_AFFINITY_ADDR"):
        monkeypatch.delenv(name, raising=False)


def test_the_worker_gets_the_relay_its_tier_capacity_and_the_labels_file_not_a_sandbox_id() -> None:
    pod = sandbox_pod(
        settings(worker_capacity=4, affinity_spiffe_id="spiffe://example.test/service/relay"), SPEC
    )
    assert env_of(pod) == {
        "TURNSTILE_AFFINITY_ADDR": "turnstile-affinity:50053",
        "TURNSTILE_AFFINITY_SPIFFE_ID": "spiffe://example.test/service/relay",  # SPEC O5
        "TURNSTILE_WORKER_SANDBOX_ID_FILE": "/etc/turnstile/podinfo/labels",
        "TURNSTILE_WORKER_TIER": "container",
        "TURNSTILE_WORKER_CAPACITY": "4",
    }
    [container] = pod["spec"]["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["podinfo"] == {"name": "podinfo", "mountPath": PODINFO_DIR, "readOnly": True}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["podinfo"]["downwardAPI"] == {
        "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
    }


def test_a_sandbox_without_a_tier_gives_its_worker_an_empty_tier_so_it_sends_no_label() -> None:
    pod = sandbox_pod(settings(), RuntimeSpec(sandbox_id="sb-1", tier="", client_label=None))
    assert env_of(pod)["TURNSTILE_WORKER_TIER"] == ""


def test_warm_and_cold_pods_of_a_tier_differ_only_in_name_and_labels() -> None:
    config = settings()
    cold, warm = sandbox_pod(config, SPEC), warm_pod(config, "container")
    assert cold["spec"] == warm["spec"]
    assert warm["metadata"]["labels"] == {
        LABEL_TIER: "container",
        LABEL_POOL: "warm",
        LABEL_ORIGIN: "warm-pool",
        LABEL_TEMPLATE: template_hash(config, "container"),
        LABEL_NAME: WORKER_NAME,
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    assert cold["metadata"]["labels"] == {
        LABEL_SANDBOX_ID: "sb-1",
        LABEL_CLIENT_ID: "acme",
        LABEL_TIER: "container",
        LABEL_NAME: WORKER_NAME,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def test_adopting_a_warm_pod_gives_its_labels_the_sandbox_the_worker_waits_for() -> None:
    warm = warm_pod(settings(), "container")
    patch = adoption_patch(SPEC, "42")["metadata"]["labels"]
    labels = {k: v for k, v in {**warm["metadata"]["labels"], **patch}.items() if v is not None}
    # The same labels as a cold pod of the sandbox, plus where it came from (a warm hit,
    # however late the reflector first sees it: SPEC W1).
    cold = sandbox_pod(settings(), SPEC)["metadata"]["labels"]
    assert labels == {**cold, LABEL_ORIGIN: "warm-pool"}


def test_extra_labels_never_override_the_labels_turnstile_relies_on() -> None:
    pod = warm_pod(settings(extra_labels={"team": "sandboxes"}), "container")
    assert pod["metadata"]["labels"]["team"] == "sandboxes"
    for reserved in (LABEL_SANDBOX_ID, LABEL_NAME, LABEL_MANAGED_BY, "turnstile.dev/anything"):
        with pytest.raises(ValidationError, match="set by Turnstile"):
            settings(extra_labels={reserved: "x"})
    with pytest.raises(ValidationError, match="not a valid label value"):
        settings(extra_labels={"team": "not a label"})


def test_pods_meet_the_restricted_pod_security_standard_with_a_writable_tmp() -> None:
    pod = sandbox_pod(settings(run_as_user=2000, run_as_group=3000, tmp_size_limit="1Gi"), SPEC)
    spec = pod["spec"]
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 2000,
        "runAsGroup": 3000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC"))
    [container] = spec["containers"]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
    assert all(set(v) & {"downwardAPI", "emptyDir"} for v in spec["volumes"]), "no hostPath"


def test_root_is_refused_as_the_pods_user() -> None:
    with pytest.raises(ValidationError, match="run_as_user"):
        settings(run_as_user=0)


def test_resources_and_grace_come_from_settings_and_empty_ones_are_left_out() -> None:
    config = settings(
        cpu_request="1", memory_request="", cpu_limit="", memory_limit="2Gi", termination_grace_s=3
    )
    pod = warm_pod(config, "container")
    [container] = pod["spec"]["containers"]
    assert container["resources"] == {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    assert pod["spec"]["terminationGracePeriodSeconds"] == 3
    no_limits = settings(cpu_request="", memory_request="", memory_limit="")
    assert "resources" not in warm_pod(no_limits, "container")["spec"]["containers"][0]


#: Two tiers that are two runtimes: plain containers, and Kata microVMs on their own nodes.
TIERS = {
    "container": {"warm_pool_size": 2},
    "microvm": {
        "runtime_class_name": "kata",
        "cpu_request": "500m",
        "memory_limit": "2Gi",
        "node_selector": {"turnstile.dev/runtime": "kata"},
        "tolerations": [
            {"key": "turnstile.dev/microvm", "operator": "Exists", "effect": "NoSchedule"},
            {
                "key": "node.kubernetes.io/unreachable",
                "effect": "NoExecute",
                "value": "",
                "operator": "Exists",
                "toleration_seconds": 30,
            },
        ],
        "warm_pool_size": 1,
    },
}
MICROVM = RuntimeSpec(sandbox_id="sb-2", tier="microvm", client_label="acme")


def test_each_tier_runs_on_its_own_runtime_class_nodes_and_resources() -> None:
    config = settings(tier_runtimes=TIERS)
    micro = sandbox_pod(config, MICROVM)["spec"]
    assert micro["runtimeClassName"] == "kata"
    assert micro["nodeSelector"] == {"turnstile.dev/runtime": "kata"}
    assert micro["tolerations"] == [
        {"key": "turnstile.dev/microvm", "operator": "Exists", "effect": "NoSchedule"},
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        },
    ]
    assert micro["containers"][0]["resources"] == {
        "requests": {"cpu": "500m", "memory": "512Mi"},
        "limits": {"memory": "2Gi"},
    }
    plain = sandbox_pod(config, SPEC)["spec"]
    for field in ("runtimeClassName", "nodeSelector", "tolerations"):
        assert field not in plain, f"the container tier runs the cluster default ({field})"
    assert plain["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "512Mi"},
        "limits": {"memory": "1Gi"},
    }


def test_the_template_hash_changes_with_the_tiers_runtime_and_nothing_else() -> None:
    plain, with_tiers = settings(), settings(tier_runtimes=TIERS)
    assert template_hash(plain, "microvm") != template_hash(with_tiers, "microvm")
    assert template_hash(plain, "container") == template_hash(with_tiers, "container")
    assert template_hash(plain, "container") != template_hash(
        settings(image="other:2"), "container"
    )
    assert template_hash(with_tiers, "microvm") == template_hash(
        settings(tier_runtimes=TIERS), "microvm"
    )
    first, second = warm_pod(with_tiers, "microvm"), warm_pod(with_tiers, "microvm")
    assert first["metadata"]["name"] != second["metadata"]["name"]
    assert first["metadata"]["labels"] == second["metadata"]["labels"]


def test_a_warm_pod_of_a_tier_carries_that_tiers_runtime_as_a_cold_pod_does() -> None:
    config = settings(tier_runtimes=TIERS)
    for tier, spec in (("microvm", MICROVM), ("container", SPEC)):
        assert warm_pod(config, tier)["spec"] == sandbox_pod(config, spec)["spec"]
    assert warm_pod(config, "microvm")["spec"] != warm_pod(config, "container")["spec"]


def test_every_tiers_pod_meets_the_restricted_profile() -> None:
    config = settings(tier_runtimes=TIERS)
    for tier in ("container", "microvm", "undeclared"):
        assert not restricted_violations(warm_pod(config, tier)), tier
    assert not restricted_violations(sandbox_pod(config, MICROVM))


@pytest.mark.parametrize("version", ["1.31.0", str(latest_version())])
def test_both_kinds_of_pod_validate_against_the_kubernetes_schema(version: str) -> None:
    config = settings(service_account="sandbox", extra_labels={"team": "a"}, tier_runtimes=TIERS)
    restore = RuntimeSpec(sandbox_id="sb-2", tier="microvm", client_label=None, restore=True)
    pods = (sandbox_pod(config, SPEC), sandbox_pod(config, restore), warm_pod(config, "x"))
    for pod in (*pods, warm_pod(config, "microvm"), sandbox_pod(config, MICROVM)):
        kubernetes_validate.validate(pod, version, strict=True)


def test_the_relay_address_defaults_to_the_services_own_and_a_k8s_override_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert KubernetesSettings().affinity_addr == "127.0.0.1:50053"
    monkeypatch.setenv("TURNSTILE_AFFINITY_ADDR", "turnstile-affinity:50053")
    assert KubernetesSettings().affinity_addr == "turnstile-affinity:50053"
    monkeypatch.setenv("TURNSTILE_K8S_AFFINITY_ADDR", "turnstile-affinity.turnstile.svc:50053")
    assert KubernetesSettings().affinity_addr == "turnstile-affinity.turnstile.svc:50053"
