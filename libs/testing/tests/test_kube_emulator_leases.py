"""Leases through the real kubernetes-asyncio client: the API server's rules leader election
relies on (optimistic concurrency above all)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from turnstile_testing.kube_emulator import KubeEmulator, pod_manifest


@pytest.fixture
async def coordination(kube: KubeEmulator) -> AsyncIterator[Any]:
    async with kube.api_client() as api:
        yield client.CoordinationV1Api(api)


def lease(name: str, holder: str = "a", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, **spec},
    }


async def test_create_then_get(coordination: Any) -> None:
    created = await coordination.create_namespaced_lease("ns", lease("l1"))
    got = await coordination.read_namespaced_lease("l1", "ns")

    assert got.spec.holder_identity == "a"
    assert got.metadata.uid == created.metadata.uid
    assert got.metadata.resource_version == created.metadata.resource_version


async def test_create_on_a_taken_name_is_already_exists(coordination: Any) -> None:
    await coordination.create_namespaced_lease("ns", lease("l1"))

    with pytest.raises(ApiException) as caught:
        await coordination.create_namespaced_lease("ns", lease("l1", "b"))

    assert caught.value.status == 409
    assert '"reason":"AlreadyExists"' in str(caught.value.body)


async def test_replace_with_a_stale_version_conflicts_and_changes_nothing(
    kube: KubeEmulator, coordination: Any
) -> None:
    first = await coordination.create_namespaced_lease("ns", lease("l1"))
    first.spec.holder_identity = "b"
    await coordination.replace_namespaced_lease("l1", "ns", first)
    first.spec.holder_identity = "c"  # still carries the version before b's write

    with pytest.raises(ApiException) as caught:
        await coordination.replace_namespaced_lease("l1", "ns", first)

    assert caught.value.status == 409
    assert '"reason":"Conflict"' in str(caught.value.body)
    assert kube.lease("ns", "l1")["spec"]["holderIdentity"] == "b"  # type: ignore[index]


async def test_replace_without_a_version_is_unconditional(coordination: Any) -> None:
    await coordination.create_namespaced_lease("ns", lease("l1"))

    replaced = await coordination.replace_namespaced_lease("l1", "ns", lease("l1", "z"))

    assert replaced.spec.holder_identity == "z"


async def test_versions_are_shared_with_pods(kube: KubeEmulator, coordination: Any) -> None:
    kube.create_pod("ns", pod_manifest("p1"))
    created = await coordination.create_namespaced_lease("ns", lease("l1"))
    kube.create_pod("ns", pod_manifest("p2"))

    assert int(created.metadata.resource_version) == 2
    assert kube.resource_version == 3


async def test_invalid_spec_is_422(coordination: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await coordination.create_namespaced_lease("ns", lease("l1", leaseDurationSeconds=0))

    assert caught.value.status == 422
    assert "spec.leaseDurationSeconds" in str(caught.value.body)


async def test_merge_patch_and_delete(kube: KubeEmulator, coordination: Any) -> None:
    await coordination.create_namespaced_lease("ns", lease("l1"))

    patched = await coordination.patch_namespaced_lease(
        "l1", "ns", {"spec": {"holderIdentity": "p"}}
    )
    await coordination.delete_namespaced_lease("l1", "ns")

    assert patched.spec.holder_identity == "p"
    assert kube.lease("ns", "l1") is None
    with pytest.raises(ApiException) as caught:
        await coordination.read_namespaced_lease("l1", "ns")
    assert caught.value.status == 404


async def test_list_is_per_namespace(coordination: Any) -> None:
    await coordination.create_namespaced_lease("ns", lease("l1"))
    await coordination.create_namespaced_lease("other", lease("l2"))

    listed = await coordination.list_namespaced_lease("ns")
    everywhere = await coordination.list_lease_for_all_namespaces()

    assert [item.metadata.name for item in listed.items] == ["l1"]
    assert sorted(item.metadata.name for item in everywhere.items) == ["l1", "l2"]
