"""The reflector's index: what counts as live, per-key counts that follow the key set,
and the raw-JSON pod parsing it is fed with."""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnstile_clientkeys import SHARED, UNATTRIBUTED, BoundedKey, KeySet, Resolver
from turnstile_substrate.kubernetes.api import KubeApiError, parse_event
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.podinfo import PodInfo, parse_pod
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
)


def pod_json(
    name: str,
    *,
    sandbox: str | None = None,
    client: str | None = None,
    tier: str = "default",
    pool: bool = False,
    phase: str | None = "Running",
    deleting: bool = False,
    node: str | None = None,
    rv: str = "1",
) -> dict[str, Any]:
    labels = {LABEL_TIER: tier}
    if sandbox is not None:
        labels[LABEL_SANDBOX_ID] = sandbox
    if client is not None:
        labels[LABEL_CLIENT_ID] = client
    if pool:
        labels[LABEL_POOL] = "warm"
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": f"uid-{name}",
        "resourceVersion": rv,
        "labels": labels,
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T00:00:00Z"
    pod: dict[str, Any] = {"metadata": meta, "spec": {"containers": [{"name": "c"}]}}
    if node is not None:
        pod["spec"]["nodeName"] = node
    if phase is not None:
        pod["status"] = {"phase": phase}
    return pod


def pod(name: str, **kwargs: Any) -> PodInfo:
    return parse_pod(pod_json(name, **kwargs))


def resolver(*allowed: str, version: int = 1) -> Resolver:
    return Resolver(KeySet(version=version, allowlist=frozenset(allowed)))


def test_parse_pod_reads_identity_labels_phase_deletion_and_node() -> None:
    info = parse_pod(
        pod_json("p1", sandbox="sb", client="acme", phase="Pending", node="n1", rv="42")
    )
    assert (info.name, info.namespace, info.uid, info.resource_version) == (
        "p1",
        "ns",
        "uid-p1",
        "42",
    )
    assert (info.sandbox_id, info.client_label, info.tier) == ("sb", "acme", "default")
    assert (info.phase, info.node, info.deleting, info.pooled) == ("Pending", "n1", False, False)
    assert info.live


def test_parse_pod_without_status_or_labels_is_a_pending_pod_of_nobody() -> None:
    info = parse_pod({"metadata": {"name": "bare"}})
    assert info.phase == "Pending"
    assert info.sandbox_id is None
    assert info.client_label is None
    assert info.tier == ""
    assert not info.is_sandbox
    assert not info.is_warm


def test_terminating_and_finished_pods_are_not_live() -> None:
    assert not pod("a", sandbox="s", deleting=True).live
    assert not pod("b", sandbox="s", phase="Succeeded").live
    assert not pod("c", sandbox="s", phase="Failed").live
    assert pod("d", sandbox="s", phase="Pending").live
    assert pod("e", sandbox="s", phase="Unknown").live


def test_parse_event_reads_pods_and_bookmarks_and_raises_on_error_events() -> None:
    added = parse_event(json.dumps({"type": "ADDED", "object": pod_json("p", rv="7")}).encode())
    assert added.type == "ADDED"
    assert added.resource_version == "7"
    assert added.pod is not None
    assert added.pod.name == "p"
    bookmark = parse_event(
        json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}).encode()
    )
    assert (bookmark.type, bookmark.resource_version, bookmark.pod) == ("BOOKMARK", "9", None)
    error = {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
    with pytest.raises(KubeApiError) as raised:
        parse_event(json.dumps(error).encode())
    assert raised.value.gone


def test_counts_live_sandbox_pods_per_bounded_key() -> None:
    index = PodIndex(resolver("acme"))
    index.replace(
        [
            pod("p1", sandbox="s1", client="acme"),
            pod("p2", sandbox="s2", client="acme"),
            pod("p3", sandbox="s3", client="globex"),  # not allowlisted: shared
            pod("p4", sandbox="s4"),  # no client label: unattributed
            pod("p5", sandbox="s5", client="acme", deleting=True),
            pod("p6", sandbox="s6", client="acme", phase="Succeeded"),
            pod("w1", pool=True),  # warm: nobody's
        ]
    )
    assert index.count_by_key() == {"acme": 2, SHARED: 1, UNATTRIBUTED: 1}
    assert index.count_live("acme", None, ()) == (2, frozenset())


def test_count_excludes_the_sandbox_being_activated_and_reports_live_pending() -> None:
    index = PodIndex(resolver("acme"))
    index.replace(
        [
            pod("p1", sandbox="s1", client="acme"),
            pod("p2", sandbox="s2", client="acme"),
            pod("p3", sandbox="s3", client="globex"),
        ]
    )
    live, live_pending = index.count_live("acme", "s1", ["s1", "s2", "s3", "s9"])
    assert live == 1
    # s1 is excluded, s3 is live under another key, s9 is not live at all
    assert live_pending == frozenset({"s2"})


def test_events_move_a_pod_between_keys_and_out_of_the_count() -> None:
    index = PodIndex(resolver("acme", "globex"))
    index.replace([])
    index.upsert(pod("p1", sandbox="s1", client="acme", rv="2"))
    assert index.count_by_key() == {"acme": 1}
    index.upsert(pod("p1", sandbox="s1", client="globex", rv="3"))
    assert index.count_by_key() == {"globex": 1}
    index.upsert(pod("p1", sandbox="s1", client="globex", deleting=True, rv="4"))
    assert index.count_by_key() == {}
    index.delete("p1")
    index.delete("p1")  # a repeated DELETED is harmless
    assert index.count_by_key() == {}
    assert index.count_by_client() == {}
    assert len(index) == 0


def test_key_set_change_recounts_keys_from_the_client_index() -> None:
    keys = resolver("acme", version=1)
    index = PodIndex(keys)
    index.replace(
        [pod(f"a{i}", sandbox=f"a{i}", client="acme") for i in range(3)]
        + [pod(f"g{i}", sandbox=f"g{i}", client="globex") for i in range(2)]
    )
    assert index.count_by_key() == {"acme": 3, SHARED: 2}

    keys.swap(keys.keyset.changed(allow=["globex"], remove=["acme"]))
    assert index.count_live("globex", None, ()) == (2, frozenset())
    assert index.count_by_key() == {SHARED: 3, "globex": 2}
    assert index.key_rebuilds == 1

    # an event after the change is charged by the new key set, and the rebuild is not repeated
    index.upsert(pod("g9", sandbox="g9", client="globex"))
    assert index.count_by_key() == {SHARED: 3, "globex": 3}
    assert index.key_rebuilds == 1

    keys.swap(keys.keyset.changed(flags={"own_keys": False}))
    assert index.count_by_key() == {SHARED: 6}


def test_key_rebuild_resolves_each_distinct_client_id_once() -> None:
    class CountingResolver(Resolver):
        calls = 0

        def resolve_label(self, label_value: str | None) -> BoundedKey:
            CountingResolver.calls += 1
            return super().resolve_label(label_value)

    keys = CountingResolver(KeySet(version=1))
    index = PodIndex(keys)
    index.replace(pod(f"p{i}", sandbox=f"s{i}", client=f"client-{i % 7}") for i in range(5_000))
    CountingResolver.calls = 0
    keys.swap(keys.keyset.changed(allow=["client-1"]))
    assert index.count_live("client-1", None, ())[0] == len(range(1, 5_000, 7))
    assert CountingResolver.calls == 7


def test_warm_index_lists_unclaimed_live_warm_pods_per_tier_in_arrival_order() -> None:
    changes: list[int] = []
    index = PodIndex(resolver(), on_warm_change=lambda: changes.append(1))
    index.replace([])
    index.upsert(pod("w2", pool=True, tier="gpu"))
    index.upsert(pod("w1", pool=True, tier="default"))
    index.upsert(pod("w3", pool=True, tier="default"))
    index.upsert(pod("w4", pool=True, tier="default", deleting=True))
    assert [p.name for p in index.warm("default")] == ["w1", "w3"]
    assert sorted(index.warm_tiers()) == ["default", "gpu"]
    # adopted: it leaves the warm index and starts counting
    index.upsert(pod("w1", sandbox="s1", client="acme", tier="default"))
    assert [p.name for p in index.warm("default")] == ["w3"]
    assert index.count_by_client() == {"acme": 1}
    assert changes  # the warm pool is told to look again


def test_every_way_a_sandbox_pod_stops_being_live_is_reported_once_as_gone() -> None:
    index = PodIndex(Resolver(KeySet(version=1)))
    gone: list[str] = []
    index.on_runtime_gone = lambda p: gone.append(p.name)
    index.replace(
        [
            pod(name, sandbox=f"s-{name}", rv="1")
            for name in ("deleted", "terminating", "failed", "missed", "kept")
        ]
        + [pod("warm", pool=True)]
    )
    index.delete("deleted")
    index.upsert(pod("terminating", sandbox="s-terminating", deleting=True, rv="2"))
    index.upsert(pod("terminating", sandbox="s-terminating", deleting=True, rv="3"))
    index.upsert(pod("failed", sandbox="s-failed", phase="Failed", rv="2"))
    index.upsert(pod("kept", sandbox="s-kept", rv="2"))  # still live: not gone
    index.delete("warm")  # a warm pod runs no sandbox
    assert gone == ["deleted", "terminating", "failed"]
    # a re-list that no longer has "missed" (its DELETED event was lost with a cut watch)
    index.replace([pod("kept", sandbox="s-kept", rv="4")])
    assert gone == ["deleted", "terminating", "failed", "missed"]


def _origin(pod_json_: dict[str, Any]) -> dict[str, Any]:
    pod_json_["metadata"]["labels"]["turnstile.dev/origin"] = "warm-pool"
    return pod_json_


def test_demand_names_a_warm_hit_by_the_pools_origin_label_not_the_pods_name() -> None:
    """SPEC W1: an adopted pod the cache never saw warm is still a hit (its origin label),
    and a cold pod whose name happens to hold "-warm-" is a miss."""
    demand: list[tuple[str, bool]] = []
    index = PodIndex(resolver())
    index.on_demand = lambda tier, hit: demand.append((tier, hit))
    index.replace([])
    index.upsert(parse_pod(_origin(pod_json("ts-warm-a-1", pool=True, tier="a"))))
    index.upsert(parse_pod(_origin(pod_json("ts-warm-a-1", sandbox="s1", client="acme", tier="a"))))
    index.upsert(parse_pod(_origin(pod_json("ts-warm-a-2", sandbox="s2", client="acme", tier="a"))))
    index.upsert(pod("ts-s3-warm-x", sandbox="s-warm-3", client="acme", tier="a"))
    index.upsert(pod("ts-s3-warm-x", sandbox="s-warm-3", client="acme", tier="a", rv="2"))
    restored = pod_json("ts-s4-r", sandbox="s4", client="acme", tier="a")
    restored["metadata"]["annotations"] = {"turnstile.dev/restore": "true"}
    index.upsert(parse_pod(restored))  # a restore: no warm pod would have served it
    assert demand == [("a", True), ("a", True), ("a", False)]


def test_a_relist_reports_the_demand_its_watch_gap_hid_but_not_the_first_lists_pods() -> None:
    demand: list[tuple[str, bool]] = []
    index = PodIndex(resolver())
    index.on_demand = lambda tier, hit: demand.append((tier, hit))
    warm = _origin(pod_json("ts-warm-a-1", pool=True, tier="a"))
    index.replace([pod("old", sandbox="s0", client="acme", tier="a"), parse_pod(warm)])
    assert demand == []  # what the first list finds was there before this replica looked
    # During the gap: the warm pod was adopted, a cold pod created, another came and went.
    adopted = _origin(pod_json("ts-warm-a-1", sandbox="s1", client="acme", tier="a", rv="5"))
    index.replace(
        [
            pod("old", sandbox="s0", client="acme", tier="a"),
            parse_pod(adopted),
            pod("cold", sandbox="s2", client="acme", tier="b"),
        ]
    )
    assert sorted(demand) == [("a", True), ("b", False)]
    index.replace([*index.pods.values()])
    assert len(demand) == 2  # nothing new: nothing counted again
