"""docs/operations.md stays true: every setting and every metric is in it."""

from __future__ import annotations

import enum
import importlib
import json
import pkgutil
import re
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
    return [name for name, _ in _defaults(model, prefix)]


def _defaults(model: type[BaseModel], prefix: str) -> list[tuple[str, str]]:
    """Each variable of ``model`` with its default as the tables write it."""
    found = []
    for name, field in model.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            found += _defaults(type(default), f"{prefix}{name.upper()}__")
        else:
            found.append((f"{prefix}{name.upper()}", _render(default)))
    return found


def _render(value: object) -> str:
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, (tuple, list, dict)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def _documented_defaults() -> dict[str, set[str]]:
    """Variable → the defaults its rows in the settings tables give (a variable a
    service overrides, like ``TURNSTILE_PORT``, has a row per table). A default
    cell is a value in backticks, or ``unset`` or ``empty``, perhaps followed by
    what that means."""
    rows: dict[str, set[str]] = {}
    pattern = re.compile(r"^\| `(TURNSTILE_[A-Z0-9_]+)` \| ([^|]*) \|", re.M)
    for match in pattern.finditer(DOC.read_text(encoding="utf-8")):
        cell = match[2].strip()
        if cell.startswith("`") and cell.endswith("`") and len(cell) > 1:
            cell = cell[1:-1]
        elif cell.startswith(("unset", "empty")):
            cell = cell[:5]  # "unset: what that means" / "empty: ..."
        rows.setdefault(match[1], set()).add(cell)
    return rows


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
    documented = _documented_defaults().get(variable, set())
    defaults = {
        d for cls, prefix in _settings_classes() for v, d in _defaults(cls, prefix) if v == variable
    }
    assert defaults <= documented, f"{variable}: defaults {defaults}, documented {documented}"


def test_every_metric_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    missing = sorted(name for name in _metric_names() if f"`{name}`" not in text)
    assert missing == []
