"""Session fixtures: each kustomization is built once, the Tiltfile evaluated once."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from .manifests import KUSTOMIZATIONS, REPO_ROOT, Obj, kubectl, kustomize_build, load_objects
from .tiltfile import TiltState, evaluate

TILTFILE = REPO_ROOT / "tilt" / "Tiltfile"

NO_KUBECTL = "kubectl (with its embedded kustomize) is not installed"


@cache
def _rendered(directory: Path) -> str:
    return kustomize_build(directory)


@cache
def _objects(name: str) -> list[Obj]:
    return load_objects(_rendered(KUSTOMIZATIONS[name]))


@pytest.fixture(scope="session")
def built() -> Callable[[str], list[Obj]]:
    """``built(name)``: the objects of kustomization ``name`` (base, dev, production),
    rendered and parsed once per session; tests must not modify them."""
    if kubectl() is None:
        pytest.skip(NO_KUBECTL)
    return _objects


@pytest.fixture(scope="session")
def tilt() -> TiltState:
    """What tilt/Tiltfile declares. ``kustomize()`` renders with kubectl when it is
    installed, and returns an empty stream otherwise (tests that need the objects
    skip then)."""

    def kustomizer(directory: Path) -> str:
        return _rendered(directory) if kubectl() is not None else ""

    return evaluate(TILTFILE, kustomizer)


@pytest.fixture(scope="session")
def tilt_objects(tilt: TiltState) -> list[Obj]:
    """The objects the Tiltfile hands to ``k8s_yaml``."""
    if kubectl() is None:
        pytest.skip(NO_KUBECTL)
    return tilt.k8s_objects
