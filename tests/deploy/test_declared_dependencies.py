"""Each workspace member installs what its code imports, and each service installs
only what it uses.

An import that works only because another member happens to install the package
breaks in an image built for one service alone (``uv sync --package
turnstile-<service>``). And a library that declares what only one service needs
makes every service install it: the platform's PostgreSQL and Kubernetes pieces
are extras (``turnstile-platform[postgres]``, ``[kubernetes]``) that the substrate
asks for, so admission and affinity install neither.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(p.parent for p in ROOT.glob("*/*/pyproject.toml"))
#: Distributions only the substrate installs (and the CLI's stack, for its checks).
SUBSTRATE_ONLY = {"asyncpg", "kubernetes-asyncio"}
#: Imports a member makes only when the package is there, never installed for it.
OPTIONAL = {"testing": {"testcontainers"}}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported(source: Path) -> Iterator[str]:
    """Every module a file imports, by its full dotted name (``from a import b`` as
    ``a.b``: in a namespace package only ``b`` names its distribution)."""
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@cache
def _owners() -> dict[str, str]:
    """Each installed file, by its path inside site-packages, and its distribution."""
    owners: dict[str, str] = {}
    for dist in distributions():
        for file in dist.files or ():
            owners[file.as_posix()] = _norm(dist.metadata["Name"])
    return owners


@cache
def _distribution(module: str) -> str | None:
    """The distribution that installs ``module``; None for the standard library and
    the workspace's own packages. Namespace packages (``google``, ``opentelemetry``)
    are told apart by the module's own file."""
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top.startswith("turnstile"):
        return None
    parts = module.split(".")
    for depth in range(len(parts), 0, -1):
        path = "/".join(parts[:depth])
        for candidate in (f"{path}/__init__.py", f"{path}.py"):
            if candidate in _owners():
                return _owners()[candidate]
        for candidate, owner in _owners().items():  # an extension module (.so)
            if candidate.startswith(f"{path}.") and "/" not in candidate[len(path) :]:
                return owner
    return f"?{top}"


@cache
def _lock() -> dict[str, dict[str, Any]]:
    packages = tomllib.loads((ROOT / "uv.lock").read_text())["package"]
    return {_norm(p["name"]): p for p in packages}


def _installed(name: str, extras: frozenset[str] = frozenset()) -> set[str]:
    """What ``uv sync --package <name>`` installs, read from uv.lock (with ``extras``)."""
    seen: set[tuple[str, str]] = set()
    wanted = [(name, "")] + [(name, extra) for extra in extras]
    while wanted:
        package, extra = wanted.pop()
        if (package, extra) in seen:
            continue
        seen.add((package, extra))
        entry = _lock()[package]
        listed = (
            entry.get("optional-dependencies", {}).get(extra, [])
            if extra
            else entry.get("dependencies", [])
        )
        for dependency in listed:
            dependency_name = _norm(dependency["name"])
            wanted.append((dependency_name, ""))
            wanted.extend((dependency_name, _norm(e)) for e in dependency.get("extra", []))
    return {package for package, _ in seen}


@pytest.mark.parametrize("member", MEMBERS, ids=lambda p: p.name)
def test_every_package_a_members_code_imports_is_installed_with_it(member: Path) -> None:
    """What ``uv sync --package <member>`` installs (with the member's own extras) has
    every package its code imports."""
    project = tomllib.loads((member / "pyproject.toml").read_text())["project"]
    extras = frozenset(_norm(e) for e in project.get("optional-dependencies", {}))
    installed = _installed(_norm(project["name"]), extras)
    missing: dict[str, set[str]] = {}
    for source in sorted((member / "src").rglob("*.py")):
        if "/turnstile/" in source.as_posix():  # generated code: its imports are protobuf's
            continue
        for module in _imported(source):
            if module.split(".")[0] in OPTIONAL.get(member.name, set()):
                continue
            distribution = _distribution(module)
            if distribution is not None and distribution not in installed:
                missing.setdefault(distribution, set()).add(
                    source.relative_to(member / "src").as_posix()
                )
    assert not missing, f"{member.name} imports what it does not install: {missing}"


@pytest.mark.parametrize("service", ["turnstile-admission", "turnstile-affinity"])
def test_admission_and_affinity_install_neither_postgresql_nor_kubernetes_clients(
    service: str,
) -> None:
    installed = _installed(service)
    assert "turnstile-platform" in installed
    assert not installed & SUBSTRATE_ONLY, f"{service} installs {installed & SUBSTRATE_ONLY}"


def test_the_substrate_installs_the_platforms_postgresql_and_kubernetes_pieces() -> None:
    assert _installed("turnstile-substrate") >= SUBSTRATE_ONLY
