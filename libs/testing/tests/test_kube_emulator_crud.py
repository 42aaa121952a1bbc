"""Create/get/list/update/delete through the real kubernetes-asyncio client."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiException

from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator import pod_manifest as pod_body


def status_of(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body or b"{}")
    return body


async def test_create_fills_server_fields_and_get_returns_the_stored_object(
    v1: Any,
) -> None:
    created = await v1.create_namespaced_pod("team-a", pod_body("p1", {"app": "web"}))
    fetched = await v1.read_namespaced_pod("p1", "team-a")

    assert created.metadata.uid
    assert created.metadata.creation_timestamp is not None
    assert created.metadata.namespace == "team-a"
    assert created.metadata.resource_version == "1"
    assert created.status.phase == "Pending"
    assert created.status.qos_class == "BestEffort"
    assert fetched.metadata.uid == created.metadata.uid
    assert fetched.metadata.resource_version == created.metadata.resource_version


async def test_resource_version_is_one_counter_across_namespaces(v1: Any) -> None:
    first = await v1.create_namespaced_pod("a", pod_body("p"))
    second = await v1.create_namespaced_pod("b", pod_body("p"))
    patched = await v1.patch_namespaced_pod("p", "a", {"metadata": {"labels": {"x": "1"}}})

    versions = [int(o.metadata.resource_version) for o in (first, second, patched)]
    assert versions == sorted(versions)
    assert len(set(versions)) == 3


async def test_generate_name_gives_distinct_names_with_the_prefix(v1: Any) -> None:
    body = pod_body("")
    body["metadata"] = {"generateName": "sandbox-"}
    names = {(await v1.create_namespaced_pod("ns", body)).metadata.name for _ in range(5)}

    assert len(names) == 5
    assert all(n.startswith("sandbox-") and len(n) == len("sandbox-") + 5 for n in names)


async def test_duplicate_name_is_409_already_exists_status(v1: Any) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod("ns", pod_body("p1"))

    assert caught.value.status == 409
    assert status_of(caught.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'pods "p1" already exists',
        "reason": "AlreadyExists",
        "details": {"name": "p1", "kind": "pods"},
        "code": 409,
    }


@pytest.mark.parametrize("verb", ["read", "patch", "replace", "delete"])
async def test_missing_pod_is_404_not_found_status(v1: Any, verb: str) -> None:
    calls = {
        "read": lambda: v1.read_namespaced_pod("ghost", "ns"),
        "patch": lambda: v1.patch_namespaced_pod("ghost", "ns", {"metadata": {}}),
        "replace": lambda: v1.replace_namespaced_pod("ghost", "ns", pod_body("ghost")),
        "delete": lambda: v1.delete_namespaced_pod("ghost", "ns"),
    }
    with pytest.raises(ApiException) as caught:
        await calls[verb]()

    status = status_of(caught.value)
    assert caught.value.status == 404
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "NotFound", 404)
    assert status["message"] == 'pods "ghost" not found'


async def test_pod_without_containers_is_rejected_as_invalid(v1: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod("ns", {"metadata": {"name": "p"}, "spec": {}})

    assert caught.value.status == 422
    assert status_of(caught.value)["reason"] == "Invalid"


async def test_invalid_label_value_is_rejected_as_invalid(v1: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.create_namespaced_pod("ns", pod_body("p", {"owner": "team/a"}))

    assert caught.value.status == 422


async def test_list_carries_the_current_resource_version_and_spans_namespaces(
    v1: Any,
) -> None:
    await v1.create_namespaced_pod("a", pod_body("p1"))
    await v1.create_namespaced_pod("b", pod_body("p2"))

    in_a = await v1.list_namespaced_pod("a")
    everywhere = await v1.list_pod_for_all_namespaces()

    assert [p.metadata.name for p in in_a.items] == ["p1"]
    assert [(p.metadata.namespace, p.metadata.name) for p in everywhere.items] == [
        ("a", "p1"),
        ("b", "p2"),
    ]
    assert everywhere.metadata.resource_version == "2"


async def test_delete_returns_the_pod_with_the_deletion_version_and_removes_it(
    v1: Any, kube: KubeEmulator
) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))
    deleted = await v1.delete_namespaced_pod("p1", "ns", grace_period_seconds=30)

    assert deleted.metadata.name == "p1"
    assert deleted.metadata.resource_version == str(kube.resource_version)
    assert kube.pods() == []


async def test_delete_with_stale_precondition_is_409(v1: Any) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))
    await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"x": "1"}}})

    with pytest.raises(ApiException) as caught:
        await v1.delete_namespaced_pod(
            "p1",
            "ns",
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="1")),
        )
    assert caught.value.status == 409
    assert status_of(caught.value)["reason"] == "Conflict"


async def test_put_with_stale_resource_version_is_409_and_current_one_succeeds(
    v1: Any,
) -> None:
    pod = await v1.create_namespaced_pod("ns", pod_body("p1"))
    await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"x": "1"}}})

    pod.metadata.labels = {"x": "2"}
    with pytest.raises(ApiException) as caught:
        await v1.replace_namespaced_pod("p1", "ns", pod)
    assert caught.value.status == 409
    assert "the object has been modified" in status_of(caught.value)["message"]

    fresh = await v1.read_namespaced_pod("p1", "ns")
    fresh.metadata.labels = {"x": "2"}
    replaced = await v1.replace_namespaced_pod("p1", "ns", fresh)
    assert replaced.metadata.labels == {"x": "2"}


async def test_main_resource_update_keeps_status_and_status_subresource_writes_it(
    v1: Any,
) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))

    via_main = await v1.patch_namespaced_pod(
        "p1", "ns", {"status": {"phase": "Running"}, "metadata": {"labels": {"a": "b"}}}
    )
    via_status = await v1.patch_namespaced_pod_status(
        "p1", "ns", {"status": {"phase": "Running"}, "metadata": {"labels": {"c": "d"}}}
    )

    assert via_main.status.phase == "Pending"
    assert via_main.metadata.labels == {"a": "b"}
    assert via_status.status.phase == "Running"
    assert via_status.metadata.labels == {"a": "b"}


async def test_update_that_changes_nothing_keeps_the_resource_version(
    v1: Any, kube: KubeEmulator
) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1", {"a": "b"}))
    before = kube.resource_version

    same = await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"a": "b"}}})

    assert same.metadata.resource_version == str(before)
    assert kube.resource_version == before


async def test_spec_node_name_cannot_be_set_by_an_update(v1: Any) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod("p1", "ns", {"spec": {"nodeName": "node-1"}})

    assert caught.value.status == 422


async def test_paginated_list_is_a_consistent_snapshot(v1: Any, kube: KubeEmulator) -> None:
    for i in range(5):
        kube.create_pod("ns", pod_body(f"p{i}"))

    first = await v1.list_namespaced_pod("ns", limit=2)
    kube.delete_pod("ns", "p3")
    kube.create_pod("ns", pod_body("p9"))
    second = await v1.list_namespaced_pod("ns", limit=2, _continue=first.metadata._continue)
    third = await v1.list_namespaced_pod("ns", limit=2, _continue=second.metadata._continue)

    names = [p.metadata.name for page in (first, second, third) for p in page.items]
    assert names == ["p0", "p1", "p2", "p3", "p4"]
    assert first.metadata.remaining_item_count == 3
    assert third.metadata._continue is None
    assert {page.metadata.resource_version for page in (first, second, third)} == {"5"}


async def test_continue_token_older_than_compaction_is_410_expired(
    v1: Any, kube: KubeEmulator
) -> None:
    for i in range(3):
        kube.create_pod("ns", pod_body(f"p{i}"))
    first = await v1.list_namespaced_pod("ns", limit=1)
    kube.create_pod("ns", pod_body("late"))
    kube.compact()

    with pytest.raises(ApiException) as caught:
        await v1.list_namespaced_pod("ns", limit=1, _continue=first.metadata._continue)
    assert caught.value.status == 410
    assert status_of(caught.value)["reason"] == "Expired"


async def test_exact_list_rebuilds_an_old_version_until_it_is_compacted(
    v1: Any, kube: KubeEmulator
) -> None:
    kube.create_pod("ns", pod_body("a", {"v": "1"}))
    at = str(kube.resource_version)
    kube.mutate_pod("ns", "a", lambda p: p["metadata"]["labels"].update(v="2"))
    kube.create_pod("ns", pod_body("b"))

    old = await v1.list_namespaced_pod("ns", resource_version=at, resource_version_match="Exact")
    assert [(p.metadata.name, p.metadata.labels["v"]) for p in old.items] == [("a", "1")]

    kube.compact()
    with pytest.raises(ApiException) as caught:
        await v1.list_namespaced_pod("ns", resource_version=at, resource_version_match="Exact")
    assert caught.value.status == 410


async def test_pod_with_finalizer_is_marked_then_removed_when_the_finalizer_goes(
    v1: Any, kube: KubeEmulator
) -> None:
    body = pod_body("p1")
    body["metadata"]["finalizers"] = ["turnstile.dev/cleanup"]
    await v1.create_namespaced_pod("ns", body)

    marked = await v1.delete_namespaced_pod("p1", "ns")
    assert marked.metadata.deletion_timestamp is not None
    assert kube.pod("ns", "p1") is not None

    await v1.patch_namespaced_pod(
        "p1", "ns", {"metadata": {"finalizers": None}}, _content_type="application/merge-patch+json"
    )
    assert kube.pod("ns", "p1") is None


async def test_hooks_move_pods_and_the_truth_reflects_them(v1: Any, kube: KubeEmulator) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))
    kube.set_node_name("ns", "p1", "node-7")
    kube.set_pod_phase("ns", "p1", "Running", ready=True)

    seen = await v1.read_namespaced_pod("p1", "ns")
    truth = kube.pods("ns")
    assert seen.spec.node_name == "node-7"
    assert seen.status.phase == "Running"
    assert [c.type for c in seen.status.conditions] == ["Ready"]
    assert truth[0]["spec"]["nodeName"] == "node-7"
    assert truth[0]["metadata"]["resourceVersion"] == seen.metadata.resource_version


async def test_injected_failure_hits_only_the_next_matching_request(
    v1: Any, kube: KubeEmulator
) -> None:
    await v1.create_namespaced_pod("ns", pod_body("p1"))
    fault = kube.inject_failure(500, method="PATCH", path=r"/api/v1/namespaces/ns/pods/p1")

    await v1.read_namespaced_pod("p1", "ns")  # a GET does not match
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"a": "b"}}})
    patched = await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"a": "b"}}})

    assert caught.value.status == 500
    assert status_of(caught.value)["reason"] == "InternalError"
    assert fault.hits == 1
    assert fault.remaining == 0
    assert patched.metadata.labels == {"a": "b"}


async def test_unknown_paths_get_a_404_status(kube: KubeEmulator) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.get(f"{kube.url}/apis/apps/v1/deployments")
        body = await resp.json()

    assert resp.status == 404
    assert body["kind"] == "Status"
    assert body["reason"] == "NotFound"


async def test_fifty_thousand_pods_list_in_one_response(kube: KubeEmulator) -> None:
    for i in range(50_000):
        kube.create_pod("bulk", pod_body(f"p{i:05d}", {"i": str(i % 10)}))

    async with aiohttp.ClientSession() as http:
        resp = await http.get(f"{kube.url}/api/v1/namespaces/bulk/pods")
        body = await resp.json()

    assert body["metadata"]["resourceVersion"] == "50000"
    assert len(body["items"]) == 50_000
    assert body["items"][0]["metadata"]["name"] == "p00000"
