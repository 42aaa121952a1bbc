"""Closer to a real cluster: graceful deletion, the scheduler/kubelet loop, Pod Security
admission and lists at a future resourceVersion, through the real kubernetes-asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from turnstile_testing.kube_emulator import KubeEmulator, KubeletConfig, pod_manifest
from turnstile_testing.kube_emulator.store import Event

#: A pod the restricted profile admits.
RESTRICTED_SPEC: dict[str, Any] = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "main",
            "image": "busybox:1.36",
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
}


async def wait_pod(
    kube: KubeEmulator, name: str, predicate: Callable[[dict[str, Any] | None], bool]
) -> dict[str, Any] | None:
    """Wait (on the store's events, no polling) until ``predicate(pod or None)`` holds."""
    changed = asyncio.Event()

    def observe(_: Event) -> None:
        changed.set()

    kube.store.add_observer(observe)
    try:
        async with asyncio.timeout(20):
            while not predicate(pod := kube.pod("ns", name)):
                changed.clear()
                await changed.wait()
        return pod
    finally:
        kube.store.remove_observer(observe)


def core(api: Any) -> Any:
    """The typed client's methods take models; these tests send plain dicts."""
    return client.CoreV1Api(api)


def running(pod: dict[str, Any] | None) -> bool:
    return pod is not None and pod["status"]["phase"] == "Running"


@pytest.fixture
async def graceful() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator(graceful_deletion=True) as kube:
        yield kube


@pytest.fixture
async def cluster() -> AsyncIterator[KubeEmulator]:
    config = KubeletConfig(nodes=("n1", "n2"), start_delay=0.01, stop_delay=0.01)
    async with KubeEmulator(graceful_deletion=True, kubelet=config) as kube:
        yield kube


async def test_deleting_a_scheduled_pod_marks_it_terminating_for_its_grace(
    graceful: KubeEmulator,
) -> None:
    graceful.create_pod("ns", pod_manifest("p1", terminationGracePeriodSeconds=20))
    graceful.set_node_name("ns", "p1", "n1")
    async with graceful.api_client() as api:
        deleted = await core(api).delete_namespaced_pod("p1", "ns")

    assert deleted.metadata.deletion_timestamp is not None
    assert deleted.metadata.deletion_grace_period_seconds == 20
    terminating = graceful.pod("ns", "p1")
    assert terminating is not None
    assert terminating["metadata"]["deletionTimestamp"]

    graceful.finish_termination("ns", "p1")
    assert graceful.pod("ns", "p1") is None


async def test_a_second_delete_may_shorten_the_grace_and_zero_removes_at_once(
    graceful: KubeEmulator,
) -> None:
    graceful.create_pod("ns", pod_manifest("p1"))
    graceful.set_node_name("ns", "p1", "n1")
    async with graceful.api_client() as api:
        v1 = core(api)
        await v1.delete_namespaced_pod("p1", "ns", grace_period_seconds=30)
        shorter = await v1.delete_namespaced_pod("p1", "ns", grace_period_seconds=5)
        assert shorter.metadata.deletion_grace_period_seconds == 5
        await v1.delete_namespaced_pod("p1", "ns", grace_period_seconds=0)

    assert graceful.pod("ns", "p1") is None


async def test_unscheduled_and_finished_pods_are_deleted_at_once(graceful: KubeEmulator) -> None:
    graceful.create_pod("ns", pod_manifest("pending"))
    graceful.create_pod("ns", pod_manifest("failed"))
    graceful.set_node_name("ns", "failed", "n1")
    graceful.fail_pod("ns", "failed")

    graceful.delete_pod("ns", "pending")
    graceful.delete_pod("ns", "failed")

    assert graceful.pods("ns") == []


async def test_a_watch_sees_terminating_then_deleted(graceful: KubeEmulator) -> None:
    graceful.create_pod("ns", pod_manifest("p1"))
    graceful.set_node_name("ns", "p1", "n1")
    rv = graceful.resource_version
    async with graceful.api_client() as api:
        v1 = core(api)
        response = await v1.list_namespaced_pod(
            "ns", watch=True, resource_version=str(rv), _preload_content=False
        )
        graceful.delete_pod("ns", "p1")
        graceful.finish_termination("ns", "p1")
        lines = [await response.content.readline() for _ in range(2)]
        response.release()

    import json

    events = [json.loads(line) for line in lines]
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]
    assert events[0]["object"]["metadata"]["deletionTimestamp"]


async def test_the_kubelet_schedules_and_starts_pods(cluster: KubeEmulator) -> None:
    async with cluster.api_client() as api:
        v1 = core(api)
        await v1.create_namespaced_pod("ns", pod_manifest("p1"))
        await v1.create_namespaced_pod("ns", pod_manifest("p2"))

    p1 = await wait_pod(
        cluster, "p1", lambda p: p is not None and p["status"]["phase"] == "Running"
    )
    p2 = await wait_pod(
        cluster, "p2", lambda p: p is not None and p["status"]["phase"] == "Running"
    )
    assert p1 is not None
    assert p2 is not None
    assert {p1["spec"]["nodeName"], p2["spec"]["nodeName"]} == {"n1", "n2"}
    ready = {c["type"]: c["status"] for c in p1["status"]["conditions"]}
    assert ready["Ready"] == "True"
    assert p1["status"]["containerStatuses"][0]["state"]["running"]


async def test_the_kubelet_removes_terminating_pods_and_fails_on_demand(
    cluster: KubeEmulator,
) -> None:
    cluster.create_pod("ns", pod_manifest("p1"))
    cluster.create_pod("ns", pod_manifest("p2"))
    await wait_pod(cluster, "p1", running)
    await wait_pod(cluster, "p2", running)

    terminating = cluster.delete_pod("ns", "p1")
    failed = cluster.fail_pod("ns", "p2", "Evicted", "The node was low on resource: memory.")

    assert terminating["metadata"]["deletionTimestamp"]
    await wait_pod(cluster, "p1", lambda p: p is None)
    assert failed["status"]["phase"] == "Failed"
    assert failed["status"]["reason"] == "Evicted"


async def test_restricted_pod_security_refuses_a_pod_that_breaks_it() -> None:
    async with KubeEmulator(pod_security="restricted") as kube, kube.api_client() as api:
        v1 = core(api)
        with pytest.raises(ApiException) as caught:
            await v1.create_namespaced_pod("ns", pod_manifest("loose"))
        admitted = await v1.create_namespaced_pod(
            "ns", {"metadata": {"name": "tight"}, "spec": RESTRICTED_SPEC}
        )

    assert caught.value.status == 403
    body = str(caught.value.body)
    assert 'violates PodSecurity \\"restricted:latest\\"' in body or (
        'violates PodSecurity "restricted:latest"' in body
    )
    for check in ("allowPrivilegeEscalation", "unrestricted capabilities", "runAsNonRoot"):
        assert check in body
    assert admitted.metadata.name == "tight"
    assert kube.pod("ns", "loose") is None


@pytest.mark.parametrize(
    ("change", "check"),
    [
        (lambda s: s.update(hostNetwork=True), "host namespaces"),
        (lambda s: s["containers"][0]["securityContext"].update(privileged=True), "privileged"),
        (lambda s: s["securityContext"].update(runAsUser=0), "runAsUser=0"),
        (lambda s: s.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "hostPath"),
        (
            lambda s: s["containers"][0]["securityContext"]["capabilities"].update(
                add=["SYS_ADMIN"]
            ),
            "capabilities",
        ),
        (lambda s: s["securityContext"].pop("seccompProfile"), "seccompProfile"),
    ],
)
async def test_each_restricted_check(change: Callable[[dict[str, Any]], None], check: str) -> None:
    import copy

    spec = copy.deepcopy(RESTRICTED_SPEC)
    change(spec)
    async with KubeEmulator(pod_security="restricted") as kube, kube.api_client() as api:
        with pytest.raises(ApiException) as caught:
            await core(api).create_namespaced_pod("ns", {"metadata": {"name": "p"}, "spec": spec})
    assert caught.value.status == 403
    assert check in str(caught.value.body)


async def test_a_list_at_a_future_version_waits_for_it(kube: KubeEmulator) -> None:
    kube.create_pod("ns", pod_manifest("p1"))
    future = kube.resource_version + 1
    async with kube.api_client() as api:
        v1 = core(api)
        listing = asyncio.ensure_future(v1.list_namespaced_pod("ns", resource_version=str(future)))
        async with asyncio.timeout(10):  # the request reached the server and waits
            await kube.store.version_waited.wait()
        kube.create_pod("ns", pod_manifest("p2"))
        listed = await listing

    assert int(listed.metadata.resource_version) >= future
    assert [p.metadata.name for p in listed.items] == ["p1", "p2"]


async def test_a_list_at_a_version_never_reached_times_out_with_504() -> None:
    async with KubeEmulator(future_version_wait=0.05) as kube, kube.api_client() as api:
        with pytest.raises(ApiException) as caught:
            await core(api).list_namespaced_pod("ns", resource_version="99")

    assert caught.value.status == 504
    assert "Too large resource version" in str(caught.value.body)
