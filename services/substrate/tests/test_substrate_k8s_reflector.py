"""The reflector against the API-server emulator, through the real kubernetes-asyncio client:
first sync, watch resumption, re-list on 410 and on a cut connection, bookmarks, selectors."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from turnstile_clientkeys import SHARED, KeySet, Resolver
from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    MANAGED_BY,
    CountUnknown,
    LiveCount,
)
from turnstile_testing.kube_emulator import KubeEmulator

NS = "sandboxes"


@asynccontextmanager
async def substrate(
    kube: KubeEmulator, resolver: Resolver, **overrides: Any
) -> AsyncIterator[KubernetesSubstrate]:
    settings = KubernetesSettings(
        api_host=kube.url,
        namespace=NS,
        relist_backoff_s=0.01,
        relist_backoff_max_s=0.05,
        **overrides,
    )
    sub = KubernetesSubstrate(settings, resolver)
    await sub.start()
    try:
        yield sub
    finally:
        await sub.close()


def seed(
    kube: KubeEmulator, name: str, *, client: str | None = "acme", managed: bool = True
) -> None:
    labels = {LABEL_SANDBOX_ID: name, LABEL_TIER: "default"}
    if client is not None:
        labels[LABEL_CLIENT_ID] = client
    if managed:
        labels[LABEL_MANAGED_BY] = MANAGED_BY
    kube.create_pod(
        NS,
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        },
    )


def truth(kube: KubeEmulator, resolver: Resolver) -> dict[str, int]:
    """Per-key live counts computed from the emulator's pods, independently of the index."""
    counts: Counter[str] = Counter()
    for obj in kube.pods(NS):
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        phase = (obj.get("status") or {}).get("phase")
        if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or LABEL_SANDBOX_ID not in labels:
            continue
        if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
            continue
        counts[resolver.resolve_label(labels.get(LABEL_CLIENT_ID)).key] += 1
    return dict(counts)


async def caught_up(sub: KubernetesSubstrate, kube: KubeEmulator) -> None:
    reflector = sub.reflector
    await reflector.wait_until(lambda: reflector.resource_version == str(kube.resource_version), 5)


def resolver() -> Resolver:
    return Resolver(KeySet(version=1, allowlist=frozenset({"acme", "globex"})))


async def test_counts_are_unknown_and_not_ready_until_the_first_list_succeeds(
    kube: KubeEmulator,
) -> None:
    seed(kube, "s1")
    failing = kube.inject_failure(500, method="GET", watch=False, times=3)
    async with substrate(kube, resolver()) as sub:
        assert not sub.ready()
        assert sub.count_live("acme", None, ()) == CountUnknown(
            "not_synced", "the pod reflector has not finished its first list"
        )
        await sub.wait_synced(5)
        assert failing.hits == 3
        assert sub.ready()
        assert sub.count_live("acme", None, ()) == LiveCount(1)


async def test_list_is_paged_and_the_watch_starts_at_the_lists_version(
    kube: KubeEmulator,
) -> None:
    for i in range(25):
        seed(kube, f"s{i}")
    keys = resolver()
    async with substrate(kube, keys, list_page_size=7) as sub:
        await sub.wait_synced(5)
        lists = [r for r in kube.requests if r.method == "GET" and not r.is_watch]
        assert len(lists) == 4
        await kube.wait_for_watches(1)
        seed(kube, "late")
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(26)
        assert sub.reflector.lists == 1


async def test_a_cut_watch_relists_and_reconciles_changes_made_while_disconnected(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    for i in range(5):
        seed(kube, f"s{i}")
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        await kube.wait_for_watches(1)
        # all of this happens before the reflector can run again
        assert kube.cut_watches() == 1
        kube.delete_pod(NS, "s0")
        kube.mutate_pod(NS, "s1", lambda p: p["metadata"]["labels"].update({LABEL_CLIENT_ID: "x"}))
        seed(kube, "s9", client="globex")
        await sub.reflector.wait_until(lambda: sub.reflector.lists == 2, 5)
        await caught_up(sub, kube)
        assert sub.index.count_by_key() == truth(kube, keys) == {"acme": 3, "globex": 1, SHARED: 1}


async def test_an_expired_resource_version_relists(kube: KubeEmulator) -> None:
    keys = resolver()
    seed(kube, "s0")
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        await kube.wait_for_watches(1)
        # the watch ends cleanly, history moves on and is compacted before the reflector
        # resumes: its version is gone, and only a re-list can catch up
        kube.end_watches()
        seed(kube, "s1")
        kube.delete_pod(NS, "s0")
        kube.compact()
        await sub.reflector.wait_until(lambda: sub.reflector.lists == 2, 5)
        await caught_up(sub, kube)
        assert sub.index.count_by_key() == truth(kube, keys) == {"acme": 1}
        assert [p.name for p in sub.index.live_pods("s1")] == ["s1"]
        assert sub.index.live_pods("s0") == []


async def test_a_410_answer_to_the_watch_request_relists(kube: KubeEmulator) -> None:
    keys = resolver()
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        await kube.wait_for_watches(1)
        kube.inject_failure(410, watch=True)
        kube.end_watches()
        await sub.reflector.wait_until(lambda: sub.reflector.lists == 2, 5)


async def test_a_clean_watch_end_resumes_from_the_last_version_without_relisting(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        for i in range(3):
            await kube.wait_for_watches(1)
            seed(kube, f"s{i}")
            await caught_up(sub, kube)
            kube.end_watches()
        await kube.wait_for_watches(1)
        seed(kube, "s3")
        await caught_up(sub, kube)
        assert sub.reflector.lists == 1
        assert sub.count_live("acme", None, ()) == LiveCount(4)


async def test_bookmarks_keep_a_quiet_watch_resumable_after_compaction(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        await kube.wait_for_watches(1)
        # history moves on outside the selector: the watch sees no event, only bookmarks
        for i in range(5):
            seed(kube, f"other{i}", managed=False)
        await caught_up(sub, kube)
        kube.end_watches()
        kube.compact()
        await kube.wait_for_watches(1)
        seed(kube, "s1")
        await caught_up(sub, kube)
        assert sub.reflector.lists == 1
        assert sub.count_live("acme", None, ()) == LiveCount(1)


async def test_pods_leaving_and_entering_the_selector_leave_and_enter_the_count(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    seed(kube, "s1")
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        kube.mutate_pod(NS, "s1", lambda p: p["metadata"]["labels"].pop(LABEL_MANAGED_BY))
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(0)
        kube.mutate_pod(
            NS, "s1", lambda p: p["metadata"]["labels"].update({LABEL_MANAGED_BY: MANAGED_BY})
        )
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(1)


async def test_terminating_and_finished_pods_stop_counting_when_the_watch_says_so(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    seed(kube, "s1")
    seed(kube, "s2")
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        kube.set_pod_phase(NS, "s1", "Succeeded")
        kube.mutate_pod(
            NS, "s2", lambda p: p["metadata"].update({"deletionTimestamp": "2026-11-29T00:00:00Z"})
        )
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(0)


async def test_a_key_set_change_recharges_cached_pods_without_a_relist(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    seed(kube, "s1", client="acme")
    seed(kube, "s2", client="initech")
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        assert sub.count_live("initech", None, ()) == LiveCount(0)
        keys.swap(keys.keyset.changed(allow=["initech"], remove=["acme"]))
        assert sub.count_live("initech", None, ()) == LiveCount(1)
        assert sub.count_live(SHARED, None, ()) == LiveCount(1)
        assert sub.index.count_by_key() == truth(kube, keys)
        assert sub.reflector.lists == 1


async def test_a_server_answering_410_repeatedly_is_relisted_each_time_then_watched(
    kube: KubeEmulator,
) -> None:
    keys = resolver()
    seed(kube, "s1")
    refusals = kube.inject_failure(410, watch=True, times=4)
    async with substrate(kube, keys) as sub:
        await sub.wait_synced(5)
        await kube.wait_for_watches(1)
        assert refusals.hits == 4
        assert sub.reflector.lists == 5
        seed(kube, "s2")
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(2)
