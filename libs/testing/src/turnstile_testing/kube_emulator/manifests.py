"""Manifest builders for tests that need a valid pod and nothing more."""

from __future__ import annotations

from typing import Any


def pod_manifest(name: str, labels: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    """A minimal pod the emulator (and a real API server) accepts; ``spec`` adds fields."""
    return {
        "metadata": {"name": name, "labels": dict(labels or {})},
        "spec": {"containers": [{"name": "main", "image": "busybox:1.36"}], **spec},
    }
