"""Building the kustomizations and reading the objects they produce."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_ROOT = REPO_ROOT / "deploy" / "kustomize"
BASE = KUSTOMIZE_ROOT / "base"
OVERLAYS = {
    "dev": KUSTOMIZE_ROOT / "overlays" / "dev",
    "production": KUSTOMIZE_ROOT / "overlays" / "production",
}
KUSTOMIZATIONS = {"base": BASE, **OVERLAYS}

SERVICES = ("admission", "substrate", "affinity")
"""The three gRPC services, each a Deployment named turnstile-<service>."""

PORTS = {"admission": (50051, 9091), "substrate": (50052, 9092), "affinity": (50053, 9093)}
"""gRPC and metrics port of each service (the convention the services honour)."""

Obj = dict[str, Any]
"""One Kubernetes object as parsed from YAML."""

POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}


def kubectl() -> str | None:
    """The kubectl binary (it embeds kustomize), or None when it is not installed."""
    return shutil.which("kubectl")


def kustomize_build(directory: Path) -> str:
    """Render a kustomization with ``kubectl kustomize``, offline."""
    binary = kubectl()
    if binary is None:
        raise RuntimeError("kubectl is not installed")
    done = subprocess.run(
        [binary, "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return done.stdout


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_objects(text: str) -> list[Obj]:
    """Every non-empty document of a YAML stream (with libyaml when available)."""
    return [doc for doc in yaml.load_all(text, Loader=_Loader) if doc]


def of_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] == kind]


def named(objects: list[Obj], kind: str, name: str) -> Obj:
    """The one object of this kind and name; fails the test if it is missing."""
    found = [obj for obj in of_kind(objects, kind) if obj["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def config_map(objects: list[Obj], name: str) -> Obj:
    """The generated ConfigMap ``name`` (kustomize appends a content hash to the name)."""
    found = [
        obj
        for obj in of_kind(objects, "ConfigMap")
        if re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}", obj["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one generated ConfigMap {name}, found {len(found)}"
    return found[0]


def pod_template(obj: Obj) -> Obj | None:
    """The pod template of a workload (metadata + spec), or None for other kinds."""
    if obj["kind"] not in POD_TEMPLATE_KINDS:
        return None
    template: Obj = obj["spec"]["template"]
    return template


def workloads(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, pod template) for every object that creates pods."""
    for obj in objects:
        template = pod_template(obj)
        if template is not None:
            yield obj, template


def containers(template: Obj) -> list[Obj]:
    spec: Obj = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def env_value(container: Obj, name: str) -> str | None:
    """A literal env value of a container (None if unset or taken from a reference)."""
    for var in container.get("env", []):
        if var["name"] == name:
            value: str | None = var.get("value")
            return value
    return None
