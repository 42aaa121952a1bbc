"""docs/operations.md stays true: every setting and every metric is in it."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from turnstile_platform.settings import ServiceSettings

DOC = Path(__file__).resolve().parents[3] / "docs" / "operations.md"


def _settings_classes() -> list[tuple[type[BaseSettings], str]]:
    from turnstile_admission.settings import AdmissionSettings
    from turnstile_affinity.settings import AffinitySettings
    from turnstile_substrate.kubernetes.settings import KubernetesSettings
    from turnstile_substrate.settings import SubstrateSettings

    return [
        (ServiceSettings, "TURNSTILE_"),
        (AdmissionSettings, "TURNSTILE_"),
        (SubstrateSettings, "TURNSTILE_"),
        (AffinitySettings, "TURNSTILE_"),
        (KubernetesSettings, "TURNSTILE_K8S_"),
    ]


def _variables(model: type[BaseModel], prefix: str) -> list[str]:
    names = []
    for name, field in model.model_fields.items():
        default = field.default
        if isinstance(default, BaseModel):
            names += _variables(type(default), f"{prefix}{name.upper()}__")
        else:
            names.append(f"{prefix}{name.upper()}")
    return names


def _metric_names() -> set[str]:
    import turnstile_admission
    import turnstile_affinity
    import turnstile_platform
    import turnstile_substrate

    for package in (
        turnstile_platform,
        turnstile_admission,
        turnstile_substrate,
        turnstile_affinity,
    ):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if ".__main__" not in module.name and not module.name.endswith("limits_cli"):
                importlib.import_module(module.name)
    names = set()
    for metric in REGISTRY.collect():
        if metric.name.startswith("turnstile_"):
            names.add(f"{metric.name}_total" if metric.type == "counter" else metric.name)
    return names


@pytest.mark.parametrize(
    "variable",
    sorted({v for cls, prefix in _settings_classes() for v in _variables(cls, prefix)}),
)
def test_every_setting_is_documented_with_its_default(variable: str) -> None:
    assert f"`{variable}`" in DOC.read_text(encoding="utf-8")


def test_every_metric_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    missing = sorted(name for name in _metric_names() if f"`{name}`" not in text)
    assert missing == []
