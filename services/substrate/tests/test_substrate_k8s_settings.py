"""KubernetesSettings: read from TURNSTILE_K8S_* variables, validated at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from turnstile_clientkeys import Resolver
from turnstile_substrate.kubernetes import KubernetesSettings, create_substrate
from turnstile_substrate.kubernetes.tier_runtime import TierRuntime
from turnstile_substrate.settings import SubstrateSettings


def test_settings_come_from_turnstile_k8s_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_K8S_NAMESPACE", "sbx")
    monkeypatch.setenv(
        "TURNSTILE_K8S_TIER_RUNTIMES",
        '{"default": {"warm_pool_size": 3}, "microvm": {"runtime_class_name": "kata"}}',
    )
    monkeypatch.setenv("TURNSTILE_K8S_NODES", '["n1", "n2"]')
    monkeypatch.setenv("TURNSTILE_K8S_IMAGE", "registry.local/runtime:2")
    monkeypatch.setenv("TURNSTILE_K8S_EXTRA_LABELS", '{"team": "sandboxes"}')
    settings = KubernetesSettings()
    assert settings.namespace == "sbx"
    assert settings.warm_size("default") == 3
    assert settings.warm_size("microvm") == 0
    assert settings.warm_size("cpu") == 0
    assert settings.tier_runtime("microvm").runtime_class_name == "kata"
    assert settings.tier_runtime("cpu").runtime_class_name is None
    assert settings.warm_tiers() == ["default"]
    assert settings.nodes == ("n1", "n2")
    assert settings.image == "registry.local/runtime:2"
    assert settings.extra_labels == {"team": "sandboxes"}
    assert settings.label_selector == "app.kubernetes.io/managed-by=turnstile"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tier_runtimes", {"not a label!": {}}),
        ("cpu_request", "a quarter"),
        ("memory_limit", "1GB"),
        ("name_prefix", "Bad_Prefix"),
        ("watch_timeout_s", 0),
        ("namespace", ""),
    ],
)
def test_invalid_settings_fail_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        KubernetesSettings(**{field: value})  # type: ignore[arg-type]


def test_backoff_ceiling_must_not_be_below_the_first_backoff() -> None:
    with pytest.raises(ValidationError, match="relist_backoff_max_s"):
        KubernetesSettings(relist_backoff_s=5, relist_backoff_max_s=1)


@pytest.mark.parametrize(
    ("runtime", "where", "message"),
    [
        ({"warm_pool_size": -1}, "microvm.warm_pool_size", "greater than or equal to 0"),
        ({"warm_pool_size": 1001}, "microvm.warm_pool_size", "less than or equal to 1000"),
        ({"runtime_class_name": "Kata Containers"}, "microvm.runtime_class_name", "RuntimeClass"),
        ({"runtime_class_name": ""}, "microvm.runtime_class_name", "RuntimeClass"),
        ({"runtimeClassName": "kata"}, "microvm.runtimeClassName", "Extra inputs"),
        ({"memory_limit": "2GB"}, "microvm.memory_limit", "not a Kubernetes quantity"),
        ({"cpu_request": "-1"}, "microvm.cpu_request", "not a Kubernetes quantity"),
        ({"node_selector": {"bad key!": "x"}}, "microvm.node_selector", "not a valid label key"),
        ({"node_selector": {"kata": "a b"}}, "microvm.node_selector", "not a valid label value"),
        (
            {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
            "microvm.tolerations.0",
            "operator Exists takes no value",
        ),
        (
            {"tolerations": [{"operator": "Equal"}]},
            "microvm.tolerations.0",
            "an empty key needs operator Exists",
        ),
        (
            {"tolerations": [{"key": "k", "toleration_seconds": 5}]},
            "microvm.tolerations.0",
            "needs effect NoExecute",
        ),
        (
            {"tolerations": [{"key": "k", "effect": "NoWay"}]},
            "microvm.tolerations.0.effect",
            "NoSchedule",
        ),
    ],
)
def test_an_invalid_tier_runtime_fails_naming_the_tier_and_its_field(
    runtime: dict[str, object], where: str, message: str
) -> None:
    with pytest.raises(ValidationError) as caught:
        KubernetesSettings(tier_runtimes={"microvm": runtime})  # type: ignore[dict-item]
    text = str(caught.value)
    assert f"tier_runtimes.{where}" in text
    assert message in text


def test_a_tier_runtime_leaves_unset_fields_to_the_shared_template() -> None:
    settings = KubernetesSettings(
        cpu_request="100m",
        memory_limit="1Gi",
        tier_runtimes={"microvm": TierRuntime(memory_limit="4Gi", cpu_limit="")},
    )
    assert settings.tier_runtime("microvm").resources(settings) == {
        "requests": {"cpu": "100m", "memory": "512Mi"},
        "limits": {"memory": "4Gi"},
    }
    assert settings.tier_runtime("container").resources(settings) == {
        "requests": {"cpu": "100m", "memory": "512Mi"},
        "limits": {"memory": "1Gi"},
    }


def test_tier_runtimes_must_name_declared_tiers() -> None:
    settings = KubernetesSettings(
        tier_runtimes={"container": TierRuntime(), "mircovm": TierRuntime()}
    )
    assert settings.undeclared_tiers(("container", "microvm")) == ["mircovm"]
    assert settings.undeclared_tiers(()) == []  # no tiers declared: nothing to check against


def test_the_substrate_refuses_to_start_with_a_runtime_for_an_undeclared_tier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TURNSTILE_K8S_TIER_RUNTIMES", '{"mircovm": {"runtime_class_name": "kata"}}')
    settings = SubstrateSettings(tiers="container,microvm", substrate_kind="kubernetes")
    with pytest.raises(ValueError, match=r"TURNSTILE_K8S_TIER_RUNTIMES: 'mircovm' not declared"):
        create_substrate(settings, Resolver())
