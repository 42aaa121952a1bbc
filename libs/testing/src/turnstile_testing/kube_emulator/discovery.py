"""The minimal discovery documents (and namespaces) kubectl needs before it will talk about pods.

kubectl asks for aggregated discovery first; answering with plain ``application/json`` legacy
documents makes it fall back to ``/api`` + ``/api/v1`` (pods, secrets) and ``/apis`` +
``/apis/coordination.k8s.io/v1`` (leases).
"""

from __future__ import annotations

from typing import Any

SERVER_VERSION: dict[str, Any] = {
    "major": "1",
    "minor": "32",
    "gitVersion": "v1.32.0-turnstile-emulator",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.23.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}

_COORDINATION_V1 = {"groupVersion": "coordination.k8s.io/v1", "version": "v1"}

COORDINATION_GROUP: dict[str, Any] = {
    "kind": "APIGroup",
    "apiVersion": "v1",
    "name": "coordination.k8s.io",
    "versions": [_COORDINATION_V1],
    "preferredVersion": _COORDINATION_V1,
}

API_GROUP_LIST: dict[str, Any] = {
    "kind": "APIGroupList",
    "apiVersion": "v1",
    "groups": [{k: v for k, v in COORDINATION_GROUP.items() if k not in ("kind", "apiVersion")}],
}

COORDINATION_V1_RESOURCES: dict[str, Any] = {
    "kind": "APIResourceList",
    "apiVersion": "v1",
    "groupVersion": "coordination.k8s.io/v1",
    "resources": [
        {
            "name": "leases",
            "singularName": "lease",
            "namespaced": True,
            "kind": "Lease",
            "verbs": ["create", "delete", "get", "list", "patch", "update"],
        }
    ],
}

CORE_V1_RESOURCES: dict[str, Any] = {
    "kind": "APIResourceList",
    "groupVersion": "v1",
    "resources": [
        {
            "name": "namespaces",
            "singularName": "namespace",
            "namespaced": False,
            "kind": "Namespace",
            "verbs": ["get"],
            "shortNames": ["ns"],
        },
        {
            "name": "pods",
            "singularName": "pod",
            "namespaced": True,
            "kind": "Pod",
            "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"],
            "shortNames": ["po"],
            "categories": ["all"],
        },
        {
            "name": "secrets",
            "singularName": "secret",
            "namespaced": True,
            "kind": "Secret",
            "verbs": ["create", "delete", "get", "list", "patch", "update"],
        },
        {
            "name": "pods/status",
            "singularName": "",
            "namespaced": True,
            "kind": "Pod",
            "verbs": ["get", "patch", "update"],
        },
    ],
}


def api_versions(server_address: str) -> dict[str, Any]:
    """The ``/api`` document (legacy core group versions)."""
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def namespace(name: str) -> dict[str, Any]:
    """Every namespace exists in the emulator; kubectl reads one to explain a pod's 404."""
    return {
        "kind": "Namespace",
        "apiVersion": "v1",
        "metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }
