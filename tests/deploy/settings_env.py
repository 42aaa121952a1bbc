"""The environment the manifests give each container, and the variables the code reads.

``read_variables()`` walks the pydantic settings classes of every Turnstile process
(each service's ``ServiceSettings`` subclass, the Kubernetes substrate's
``KubernetesSettings``, the worker's ``WorkerSettings``) the way pydantic-settings
maps fields to variables: prefix + field name, an explicit validation alias
instead when there is one, and ``<prefix><FIELD>__<SUBFIELD>`` for nested models
when the class sets ``env_nested_delimiter``. ``container_env()`` resolves what a
container of a rendered manifest would see: its ConfigMaps (``envFrom``), literals,
Secrets and downward-API fields.
"""

from __future__ import annotations

import base64
import importlib
import os
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

from pydantic import AliasChoices, BaseModel
from pydantic_settings import BaseSettings

from .manifests import Obj, of_kind

_S = TypeVar("_S", bound=BaseSettings)

#: Modules defining the settings of every process the deployment runs.
SETTINGS_MODULES = (
    "turnstile_platform.settings",
    "turnstile_admission.settings",
    "turnstile_substrate.settings",
    "turnstile_substrate.kubernetes.settings",
    "turnstile_affinity.settings",
    "turnstile_affinity.worker.settings",
)

#: Values of Secrets the manifests reference but do not ship (production creates them).
EXTERNAL_SECRETS = {
    ("turnstile-database", "url"): "postgresql://turnstile:secret@postgresql:5432/turnstile",
}


def settings_classes() -> list[type[BaseSettings]]:
    """Every Turnstile settings class (subclasses included) the modules define."""
    for module in SETTINGS_MODULES:
        importlib.import_module(module)
    found: list[type[BaseSettings]] = []
    pending: list[type[BaseSettings]] = [BaseSettings]
    while pending:
        for sub in pending.pop().__subclasses__():
            pending.append(sub)
            if sub.__module__.startswith("turnstile_") and sub not in found:
                found.append(sub)
    return found


def variables_of(cls: type[BaseSettings]) -> set[str]:
    """The environment variables a settings class reads (upper case)."""
    config = cls.model_config
    prefix = config.get("env_prefix", "")
    delimiter = config.get("env_nested_delimiter")
    return _fields(cls, prefix, delimiter, top=True)


def _fields(model: type[BaseModel], prefix: str, delimiter: str | None, *, top: bool) -> set[str]:
    names: set[str] = set()
    for name, field in model.model_fields.items():
        alias = field.validation_alias
        if top and isinstance(alias, str):
            names.add(alias.upper())
        elif top and isinstance(alias, AliasChoices):
            names.update(c.upper() for c in alias.choices if isinstance(c, str))
        else:
            names.add(f"{prefix}{name}".upper())
        nested = field.annotation
        if delimiter and isinstance(nested, type) and issubclass(nested, BaseModel):
            names |= _fields(nested, f"{prefix}{name}{delimiter}", delimiter, top=False)
    return names


def read_variables() -> set[str]:
    """Every variable some Turnstile settings class reads."""
    return set().union(*(variables_of(cls) for cls in settings_classes()))


def _decoded(secret: Obj) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def _by_name(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in of_kind(objects, kind)}


def container_env(objects: list[Obj], workload: Obj, container: Obj) -> dict[str, str]:
    """What the container's process finds in its environment (ConfigMaps first, then
    ``env``, which wins, as the kubelet orders them)."""
    config_maps = _by_name(objects, "ConfigMap")
    secrets = _by_name(objects, "Secret")
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        assert ref in config_maps, f"envFrom names a missing ConfigMap {ref}"
        env.update(config_maps[ref]["data"])
    for var in container.get("env", []):
        env[var["name"]] = _value(var, workload, secrets)
    return env


def _value(var: Mapping[str, Any], workload: Obj, secrets: dict[str, Obj]) -> str:
    if "value" in var:
        return str(var["value"])
    source = var["valueFrom"]
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        assert path in ("metadata.namespace", "metadata.name"), f"unexpected field {path}"
        if path == "metadata.name":
            return f"{workload['metadata']['name']}-0"  # a pod name of the workload
        namespace: str = workload["metadata"].get("namespace", "default")
        return namespace
    ref = source["secretKeyRef"]
    if ref["name"] in secrets:
        return _decoded(secrets[ref["name"]])[ref["key"]]
    return EXTERNAL_SECRETS[(ref["name"], ref["key"])]


def turnstile_names(env: Mapping[str, str]) -> Iterator[str]:
    return (name for name in env if name.startswith("TURNSTILE_"))


def build_settings(cls: type[_S], env: Mapping[str, str]) -> _S:
    """``cls`` as a process whose TURNSTILE_* environment is exactly ``env`` builds it
    (the test process's own TURNSTILE_* variables are set aside meanwhile)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("TURNSTILE_")}
    try:
        for name in saved:
            del os.environ[name]
        os.environ.update({k: v for k, v in env.items() if k.startswith("TURNSTILE_")})
        return cls()
    finally:
        for name in [k for k in os.environ if k.startswith("TURNSTILE_")]:
            del os.environ[name]
        os.environ.update(saved)
