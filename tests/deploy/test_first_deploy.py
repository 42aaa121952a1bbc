"""docs/deploy.md's "First deploy, step by step" is a path that works: its steps come in
the order they depend on each other, every file it names exists, the overlay it applies
builds, and the Secrets and ConfigMaps it tells you to create are exactly the ones that
overlay's workloads mount or read and do not make themselves (nor cert-manager for them),
each in the namespace of the workloads that use it."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import pytest

from .manifests import REPO_ROOT, Obj, kubectl, kustomize_build, load_objects, of_kind, workloads

DEPLOY_DOC = REPO_ROOT / "docs" / "deploy.md"
TITLE = "## First deploy, step by step"
#: What must come before what: cert-manager's CRDs before the overlay's Certificates,
#: the namespaces before the Secrets in them, every Secret before the pods that mount it.
ORDER = ("Images", "cert-manager", "Namespaces", "Secrets", "keys", "overlay")


def section() -> str:
    text = DEPLOY_DOC.read_text()
    assert TITLE in text, f"docs/deploy.md has no '{TITLE}' section"
    return text.split(TITLE, 1)[1].split("\n## ", 1)[0]


def steps() -> list[tuple[int, str, str]]:
    """(number, bold title, body) of each numbered step."""
    found = re.findall(
        r"^(\d+)\. \*\*(.+?)\*\*(.*?)(?=^\d+\. \*\*|\Z)", section(), flags=re.M | re.S
    )
    return [(int(number), title, body) for number, title, body in found]


def step(word: str) -> str:
    (body,) = [body for _, title, body in steps() if word in title]
    return body


def applied_overlay() -> str:
    (path,) = re.findall(r"kubectl apply -k ([^\s`]+)", step("overlay"))
    return str(path)


def created(kind: str) -> set[tuple[str, str]]:
    """(namespace, name) of every ``kubectl -n NS create KIND … NAME`` in the section."""
    pattern = rf"kubectl -n ([^\s`]+) create {kind}(?: generic)? ([^\s`]+)"
    return set(re.findall(pattern, section()))


def referenced(objects: list[Obj]) -> Iterator[tuple[str, str, str]]:
    """(kind, namespace, name) of every Secret and ConfigMap a workload mounts or reads."""
    for workload, template in workloads(objects):
        namespace = workload["metadata"].get("namespace", "default")
        spec = template["spec"]
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                yield "Secret", namespace, volume["secret"]["secretName"]
            if "configMap" in volume:
                yield "ConfigMap", namespace, volume["configMap"]["name"]
            for source in volume.get("projected", {}).get("sources", []):
                if "secret" in source:
                    yield "Secret", namespace, source["secret"]["name"]
                if "configMap" in source:
                    yield "ConfigMap", namespace, source["configMap"]["name"]
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            for var in container.get("env", []):
                source = var.get("valueFrom", {})
                if "secretKeyRef" in source:
                    yield "Secret", namespace, source["secretKeyRef"]["name"]
                if "configMapKeyRef" in source:
                    yield "ConfigMap", namespace, source["configMapKeyRef"]["name"]
            for source in container.get("envFrom", []):
                if "secretRef" in source:
                    yield "Secret", namespace, source["secretRef"]["name"]
                if "configMapRef" in source:
                    yield "ConfigMap", namespace, source["configMapRef"]["name"]


def made_by_the_overlay(objects: list[Obj], kind: str) -> set[tuple[str, str]]:
    """What the overlay itself makes: its own objects, and for Secrets the ones its
    cert-manager Certificates have cert-manager write."""
    made = {
        (obj["metadata"].get("namespace", "default"), obj["metadata"]["name"])
        for obj in of_kind(objects, kind)
    }
    if kind == "Secret":
        made |= {
            (cert["metadata"].get("namespace", "default"), cert["spec"]["secretName"])
            for cert in of_kind(objects, "Certificate")
        }
    return made


@pytest.fixture(scope="module")
def overlay() -> list[Obj]:
    if kubectl() is None:
        pytest.skip("kubectl (with its embedded kustomize) is not installed")
    return load_objects(kustomize_build(REPO_ROOT / applied_overlay()))


def test_the_steps_are_numbered_in_the_order_they_depend_on() -> None:
    numbered = steps()
    assert [number for number, _, _ in numbered] == list(range(1, len(numbered) + 1))
    titles = [title for _, title, _ in numbered]
    positions = []
    for word in ORDER:
        matching = [index for index, title in enumerate(titles) if word in title]
        assert len(matching) == 1, (word, titles)
        positions.append(matching[0])
    assert positions == sorted(positions), titles


def test_every_file_the_steps_name_exists() -> None:
    # deploy/<name> alone is a kubectl resource (deploy/turnstile-admission), not a file.
    files = r"(?<![\w/.-])((?:deploy/(?:docker|kustomize|grafana|prometheus)|tilt|docs)/[\w./-]+)"
    paths = set(re.findall(files, section()))
    assert len(paths) >= 4, paths
    for path in paths:
        assert (REPO_ROOT / path.rstrip(".")).exists(), path


def test_the_overlay_it_applies_builds_and_is_the_one_it_renders_first() -> None:
    path = applied_overlay()
    assert f"kubectl kustomize {path}" in step("overlay")
    assert kubectl() is not None or pytest.skip("kubectl is not installed")
    objects = load_objects(kustomize_build(REPO_ROOT / path))
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Job", "Certificate", "Namespace"} <= kinds


@pytest.mark.parametrize("kind", ["Secret", "ConfigMap"])
def test_what_it_creates_is_exactly_what_the_overlay_mounts_and_does_not_make(
    kind: str, overlay: list[Obj]
) -> None:
    needed = {
        (namespace, name) for ref_kind, namespace, name in referenced(overlay) if ref_kind == kind
    } - made_by_the_overlay(overlay, kind)
    command = "secret" if kind == "Secret" else "configmap"
    assert created(command) == needed


def test_the_namespaces_exist_before_their_secrets_are_created() -> None:
    namespaces_file = re.findall(r"kubectl apply -f ([^\s`]+)", step("Namespaces"))
    assert namespaces_file, step("Namespaces")
    declared = {
        obj["metadata"]["name"]
        for obj in load_objects((REPO_ROOT / namespaces_file[0]).read_text())
        if obj["kind"] == "Namespace"
    }
    for namespace, _ in created("secret") | created("configmap"):
        assert namespace in declared, namespace


def test_the_path_applies_the_production_overlay(built: Callable[[str], list[Obj]]) -> None:
    """The overlay the other deploy tests check is the one this path applies."""
    assert applied_overlay() == "deploy/kustomize/overlays/production"
    assert built("production")
