"""PATCH flavours and optimistic concurrency, through the real client."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiException

from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator import pod_manifest as pod_body

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


@pytest.fixture
async def pod(kube: KubeEmulator) -> dict[str, object]:
    body = pod_body("p1", {"app": "web", "keep": "yes"})
    body["metadata"]["annotations"] = {"note": "a"}
    body["spec"]["containers"].append({"name": "side", "image": "envoy:1"})
    return kube.create_pod("ns", body)


async def test_merge_patch_sets_and_deletes_labels(pod: object, v1: Any) -> None:
    patched = await v1.patch_namespaced_pod(
        "p1", "ns", {"metadata": {"labels": {"app": None, "new": "1"}}}, _content_type=MERGE
    )

    assert patched.metadata.labels == {"keep": "yes", "new": "1"}
    assert patched.metadata.annotations == {"note": "a"}


async def test_strategic_merge_patch_merges_containers_by_name(pod: object, v1: Any) -> None:
    # A dict body makes kubernetes-asyncio choose strategic merge patch.
    patched = await v1.patch_namespaced_pod(
        "p1", "ns", {"spec": {"containers": [{"name": "side", "image": "envoy:2"}]}}
    )

    assert [(c.name, c.image) for c in patched.spec.containers] == [
        ("main", "busybox:1.36"),
        ("side", "envoy:2"),
    ]


async def test_strategic_merge_patch_merges_status_conditions_by_type(pod: object, v1: Any) -> None:
    await v1.patch_namespaced_pod_status(
        "p1", "ns", {"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}
    )
    patched = await v1.patch_namespaced_pod_status(
        "p1", "ns", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )

    assert sorted(c.type for c in patched.status.conditions) == ["PodScheduled", "Ready"]


async def test_json_patch_add_replace_remove(pod: object, v1: Any) -> None:
    patched = await v1.patch_namespaced_pod(
        "p1",
        "ns",
        [
            {"op": "add", "path": "/metadata/labels/turnstile.dev~1owner", "value": "team-a"},
            {"op": "replace", "path": "/metadata/labels/app", "value": "api"},
            {"op": "remove", "path": "/metadata/labels/keep"},
            {"op": "test", "path": "/metadata/annotations/note", "value": "a"},
        ],
    )

    assert patched.metadata.labels == {"app": "api", "turnstile.dev/owner": "team-a"}


async def test_failed_json_patch_test_is_422_and_changes_nothing(
    pod: object, v1: Any, kube: KubeEmulator
) -> None:
    before = kube.resource_version
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod(
            "p1",
            "ns",
            [
                {"op": "test", "path": "/metadata/labels/app", "value": "db"},
                {"op": "replace", "path": "/metadata/labels/app", "value": "api"},
            ],
        )

    status = json.loads(caught.value.body or b"{}")
    assert caught.value.status == 422
    assert (status["kind"], status["reason"]) == ("Status", "Invalid")
    assert kube.resource_version == before
    assert kube.pod("ns", "p1")["metadata"]["labels"]["app"] == "web"  # type: ignore[index]


async def test_json_patch_on_a_missing_path_is_422(pod: object, v1: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod(
            "p1", "ns", [{"op": "replace", "path": "/metadata/labels/absent", "value": "x"}]
        )

    assert caught.value.status == 422


async def test_malformed_json_patch_is_400(pod: object, v1: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod("p1", "ns", [{"path": "/metadata/labels/app"}])

    assert caught.value.status == 400


@pytest.mark.parametrize("content_type", [MERGE, "application/strategic-merge-patch+json"])
async def test_patch_carrying_a_stale_resource_version_is_409_conflict(
    pod: object, v1: Any, kube: KubeEmulator, content_type: str
) -> None:
    stale = str(kube.resource_version)
    kube.set_pod_phase("ns", "p1", "Running")

    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod(
            "p1",
            "ns",
            {"metadata": {"resourceVersion": stale, "labels": {"claimed": "yes"}}},
            _content_type=content_type,
        )
    current = str(kube.resource_version)
    claimed = await v1.patch_namespaced_pod(
        "p1",
        "ns",
        {"metadata": {"resourceVersion": current, "labels": {"claimed": "yes"}}},
        _content_type=content_type,
    )

    status = json.loads(caught.value.body or b"{}")
    assert caught.value.status == 409
    assert status["reason"] == "Conflict"
    assert status["message"].startswith('Operation cannot be fulfilled on pods "p1"')
    assert claimed.metadata.labels["claimed"] == "yes"


async def test_json_patch_replacing_a_stale_resource_version_is_409(pod: object, v1: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod(
            "p1", "ns", [{"op": "replace", "path": "/metadata/resourceVersion", "value": "0"}]
        )

    assert caught.value.status == 409


async def test_injected_conflict_on_the_next_patch(
    pod: object, v1: Any, kube: KubeEmulator
) -> None:
    kube.inject_failure(409, method="PATCH", path=r".*/pods/p1", times=2)

    outcomes = []
    for _ in range(3):
        try:
            await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"n": "1"}}})
            outcomes.append(200)
        except ApiException as exc:
            outcomes.append(exc.status)

    assert outcomes == [409, 409, 200]


async def test_server_side_apply_is_refused_as_unsupported(pod: object, v1: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await v1.patch_namespaced_pod(
            "p1", "ns", {"metadata": {}}, _content_type="application/apply-patch+yaml"
        )

    assert caught.value.status == 415
