"""KubernetesSettings: read from TURNSTILE_K8S_* variables, validated at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from turnstile_substrate.kubernetes import KubernetesSettings


def test_settings_come_from_turnstile_k8s_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_K8S_NAMESPACE", "sbx")
    monkeypatch.setenv("TURNSTILE_K8S_WARM_POOL_SIZES", '{"default": 3, "gpu": 1}')
    monkeypatch.setenv("TURNSTILE_K8S_NODES", '["n1", "n2"]')
    monkeypatch.setenv("TURNSTILE_K8S_IMAGE", "registry.local/runtime:2")
    monkeypatch.setenv("TURNSTILE_K8S_EXTRA_LABELS", '{"team": "sandboxes"}')
    settings = KubernetesSettings()
    assert settings.namespace == "sbx"
    assert settings.warm_size("default") == 3
    assert settings.warm_size("cpu") == 0
    assert settings.nodes == ("n1", "n2")
    assert settings.image == "registry.local/runtime:2"
    assert settings.extra_labels == {"team": "sandboxes"}
    assert settings.label_selector == "app.kubernetes.io/managed-by=turnstile"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("warm_pool_sizes", {"not a label!": 1}),
        ("warm_pool_sizes", {"default": -1}),
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
