"""Watch semantics through kubernetes-asyncio's ``Watch`` (and raw HTTP where it hides details)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiException

from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator import pod_manifest as pod_body

Summary = tuple[str, str | None, str]


def summary(event: dict[str, Any]) -> Summary:
    """(type, name, resourceVersion) of a Watch event."""
    meta = event["raw_object"]["metadata"]
    return (event["type"], meta.get("name"), meta["resourceVersion"])


async def collect(
    v1: Any, count: int, *, namespace: str | None = "ns", **kwargs: Any
) -> list[dict[str, Any]]:
    """Read ``count`` events from a fresh Watch, then close it."""
    events: list[dict[str, Any]] = []
    func: Callable[..., Coroutine[Any, Any, Any]]
    args: tuple[str, ...]
    func, args = (
        (v1.list_namespaced_pod, (namespace,))
        if namespace
        else (v1.list_pod_for_all_namespaces, ())
    )
    async with watch.Watch() as w, asyncio.timeout(10):
        async for event in w.stream(func, *args, **kwargs):
            events.append(event)
            if len(events) == count:
                break
    return events


def start(coro: Coroutine[Any, Any, list[dict[str, Any]]]) -> asyncio.Task[list[dict[str, Any]]]:
    return asyncio.get_running_loop().create_task(coro)


async def test_client_sends_capitalised_watch_true_and_it_is_accepted(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("p1"))

    events = await collect(v1, 1)

    watch_requests = [r for r in kube.requests if r.is_watch]
    assert watch_requests[0].query["watch"] == "True"
    assert summary(events[0]) == ("ADDED", "p1", "1")


async def test_watch_without_resource_version_starts_with_current_matching_pods(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("a", {"app": "web"}))
    kube.create_pod("ns", pod_body("b", {"app": "db"}))
    kube.create_pod("other", pod_body("c", {"app": "web"}))

    task = start(collect(v1, 2, label_selector="app=web"))
    await kube.wait_for_watches(1)
    kube.create_pod("ns", pod_body("d", {"app": "web"}))
    events = await task

    assert [summary(e) for e in events] == [("ADDED", "a", "1"), ("ADDED", "d", "4")]


async def test_watch_from_a_resource_version_replays_what_came_after_it(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("a"))
    since = str(kube.resource_version)
    kube.create_pod("ns", pod_body("b"))
    kube.set_pod_phase("ns", "a", "Running")
    kube.delete_pod("ns", "b")

    events = await collect(v1, 3, resource_version=since)

    assert [summary(e) for e in events] == [
        ("ADDED", "b", "2"),
        ("MODIFIED", "a", "3"),
        ("DELETED", "b", "4"),
    ]
    assert events[1]["object"].status.phase == "Running"


async def test_bookmarks_carry_the_latest_delivered_version(kube: KubeEmulator, v1: Any) -> None:
    kube.create_pod("ns", pod_body("a"))
    kube.create_pod("elsewhere", pod_body("z"))

    events = await collect(v1, 3, resource_version="1", allow_watch_bookmarks=True)

    assert [e["type"] for e in events] == ["BOOKMARK"] * 3
    assert {e["raw_object"]["metadata"]["resourceVersion"] for e in events} == {"2"}
    assert events[0]["raw_object"]["kind"] == "Pod"


async def test_no_bookmarks_unless_asked(kube: KubeEmulator, v1: Any) -> None:
    kube.create_pod("ns", pod_body("a"))

    events: list[dict[str, Any]] = []
    async with watch.Watch() as w:
        async for event in w.stream(v1.list_namespaced_pod, "ns", timeout_seconds=1):
            events.append(event)

    assert [e["type"] for e in events] == ["ADDED"]


async def test_timeout_seconds_ends_the_stream(kube: KubeEmulator, v1: Any) -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    async with watch.Watch() as w, asyncio.timeout(5):
        received = [e async for e in w.stream(v1.list_namespaced_pod, "ns", timeout_seconds=1)]

    assert received == []
    assert 0.9 <= loop.time() - began < 3
    await kube.wait_for_watches(0)


async def test_selector_exit_is_deleted_and_entry_is_added(kube: KubeEmulator, v1: Any) -> None:
    kube.create_pod("ns", pod_body("p1", {"pool": "warm"}))

    task = start(collect(v1, 3, label_selector="pool=warm"))
    await kube.wait_for_watches(1)
    await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"pool": "claimed"}}})
    await v1.patch_namespaced_pod("p1", "ns", {"metadata": {"labels": {"pool": "warm"}}})
    events = await task

    assert [summary(e) for e in events] == [
        ("ADDED", "p1", "1"),
        ("DELETED", "p1", "2"),
        ("ADDED", "p1", "3"),
    ]
    # DELETED carries the last matching content, stamped with the version that un-matched it.
    assert events[1]["raw_object"]["metadata"]["labels"] == {"pool": "warm"}


async def test_field_selector_watch_sees_binding_to_a_node_as_added(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("p1"))

    task = start(collect(v1, 1, namespace=None, field_selector="spec.nodeName=node-1"))
    await kube.wait_for_watches(1)
    kube.create_pod("ns", pod_body("p2"))  # not on node-1: not sent
    kube.set_node_name("ns", "p1", "node-1")
    events = await task

    assert [summary(e) for e in events] == [("ADDED", "p1", "3")]


async def test_watch_from_a_compacted_version_raises_410_with_timeout_seconds(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("a"))
    kube.create_pod("ns", pod_body("b"))
    kube.compact()

    with pytest.raises(ApiException) as caught:
        await collect(v1, 1, resource_version="1", timeout_seconds=5)

    assert caught.value.status == 410
    assert "Expired" in str(caught.value.reason)


async def test_watch_without_timeout_retries_a_410_once_then_raises(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("a"))
    kube.create_pod("ns", pod_body("b"))
    kube.compact()

    with pytest.raises(ApiException) as caught:
        await collect(v1, 1, resource_version="1")

    assert caught.value.status == 410
    assert len([r for r in kube.requests if r.is_watch]) == 2


async def test_expired_watch_is_http_200_with_an_error_event_carrying_a_status(
    kube: KubeEmulator,
) -> None:
    kube.create_pod("ns", pod_body("a"))
    kube.create_pod("ns", pod_body("b"))
    kube.create_pod("ns", pod_body("c"))
    kube.compact(keep=1)  # forgets versions 1 and 2

    async with aiohttp.ClientSession() as http:
        resp = await http.get(f"{kube.url}/api/v1/namespaces/ns/pods?watch=true&resourceVersion=0")
        fine = await resp.content.readline()
        resp.close()
        resp = await http.get(
            f"{kube.url}/api/v1/namespaces/ns/pods?watch=1&resourceVersion=1&timeoutSeconds=2"
        )
        lines = (await resp.read()).splitlines()

    assert json.loads(fine)["type"] == "ADDED"
    assert resp.status == 200
    assert [json.loads(line) for line in lines] == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "too old resource version: 1 (2)",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]


async def test_cut_watches_breaks_the_connection_mid_stream(kube: KubeEmulator, v1: Any) -> None:
    kube.create_pod("ns", pod_body("a"))
    received: list[str] = []

    async def watch_forever() -> None:
        async with watch.Watch() as w:
            async for event in w.stream(v1.list_namespaced_pod, "ns", timeout_seconds=60):
                received.append(event["type"])

    task = asyncio.get_running_loop().create_task(watch_forever())
    await kube.wait_for_watches(1)

    assert kube.cut_watches() == 1
    with pytest.raises(aiohttp.ClientPayloadError):
        await asyncio.wait_for(task, 5)
    assert kube.watch_count == 0


async def test_end_watches_closes_streams_cleanly(kube: KubeEmulator, v1: Any) -> None:
    async def watch_once() -> int:
        async with watch.Watch() as w:
            return len(
                [e async for e in w.stream(v1.list_namespaced_pod, "ns", timeout_seconds=60)]
            )

    task = asyncio.get_running_loop().create_task(watch_once())
    await kube.wait_for_watches(1)
    kube.end_watches()

    assert await asyncio.wait_for(task, 5) == 0


async def test_closing_the_client_releases_the_server_side_watch(
    kube: KubeEmulator, v1: Any
) -> None:
    kube.create_pod("ns", pod_body("a"))
    await collect(v1, 1)

    await kube.wait_for_watches(0)
    assert kube.watch_count == 0


async def test_injected_failure_can_target_only_watches(kube: KubeEmulator, v1: Any) -> None:
    kube.inject_failure(503, method="GET", path="/api/v1/namespaces/ns/pods", watch=True)

    listed = await v1.list_namespaced_pod("ns")
    with pytest.raises(ApiException) as caught:
        await collect(v1, 1, timeout_seconds=5)

    assert listed.items == []
    assert caught.value.status == 503


async def test_send_initial_events_ends_with_an_annotated_bookmark(kube: KubeEmulator) -> None:
    kube.create_pod("ns", pod_body("a"))
    kube.create_pod("ns", pod_body("b"))
    url = (
        f"{kube.url}/api/v1/namespaces/ns/pods?watch=true&sendInitialEvents=true"
        "&allowWatchBookmarks=true&resourceVersionMatch=NotOlderThan&timeoutSeconds=1"
    )
    async with aiohttp.ClientSession() as http:
        resp = await http.get(url)
        first = [json.loads(await resp.content.readline()) for _ in range(3)]
        resp.close()

    assert [e["type"] for e in first] == ["ADDED", "ADDED", "BOOKMARK"]
    assert first[2]["object"]["metadata"] == {
        "resourceVersion": "2",
        "annotations": {"k8s.io/initial-events-end": "true"},
    }


async def test_a_burst_of_writes_arrives_complete_and_in_order(kube: KubeEmulator, v1: Any) -> None:
    kube.create_pod("ns", pod_body("hot"))
    writes = 2_000

    task = start(collect(v1, writes, resource_version=str(kube.resource_version)))
    await kube.wait_for_watches(1)
    for i in range(writes):

        def annotate(pod: dict[str, Any], n: int = i) -> None:
            pod["metadata"].update(annotations={"n": str(n)})

        kube.mutate_pod("ns", "hot", annotate)
    events = await task

    versions = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == list(range(2, writes + 2))
    assert events[-1]["raw_object"]["metadata"]["annotations"] == {"n": str(writes - 1)}


async def test_stopping_the_emulator_ends_open_watches_promptly() -> None:
    emulator = KubeEmulator()
    await emulator.start()
    async with emulator.api_client() as api:
        core = client.CoreV1Api(api)

        async def watch_all() -> list[str]:
            async with watch.Watch() as w:
                stream = w.stream(core.list_namespaced_pod, "ns", timeout_seconds=60)
                return [e["type"] async for e in stream]

        task = asyncio.get_running_loop().create_task(watch_all())
        await emulator.wait_for_watches(1)
        loop = asyncio.get_running_loop()
        began = loop.time()
        await emulator.stop()

        assert await asyncio.wait_for(task, 5) == []
        assert loop.time() - began < 1.5
