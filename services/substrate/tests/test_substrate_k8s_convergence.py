"""Reflector convergence, property-based (SPEC S3, P6).

Hypothesis drives random histories against the API-server emulator — creates, label
patches through the real client (client-id changes, leaving and entering the selector),
phase changes, graceful and immediate deletes, warm pods, watch cuts, clean watch ends,
history compactions, key-set changes — interleaved at random points with the reflector's
own progress. Once the history settles, the reflector's per-key and per-client counts,
its answers to ``count_live`` (with exclusion and pending ids) and its warm-pod view must
equal what the emulator holds. The long variant checks at many checkpoints along one long
history that nothing drifts.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes_asyncio import client as k8s

from turnstile_clientkeys import NATIVE, SHARED, UNATTRIBUTED, KeySet, Resolver
from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    MANAGED_BY,
    LiveCount,
)
from turnstile_testing.kube_emulator import KubeEmulator

NS = "sandboxes"
PODS = 12
CLIENTS: tuple[str | None, ...] = ("acme", "globex", "initech", "native", None)
KEYS = ("acme", "globex", "initech", SHARED, NATIVE, UNATTRIBUTED)
PHASES = ("Pending", "Running", "Succeeded", "Failed")

pod_ids = st.integers(0, PODS - 1)
clients = st.sampled_from(CLIENTS)
changes = st.one_of(
    st.tuples(st.just("create"), pod_ids, clients, st.booleans()),
    st.tuples(st.just("relabel"), pod_ids, clients),
    st.tuples(st.just("unmanage"), pod_ids),
    st.tuples(st.just("manage"), pod_ids),
    st.tuples(st.just("phase"), pod_ids, st.sampled_from(PHASES)),
    st.tuples(st.just("terminate"), pod_ids),
    st.tuples(st.just("delete"), pod_ids),
    st.tuples(st.just("adopt"), pod_ids, clients),
    st.tuples(st.just("keyset"), st.sampled_from(("acme", "globex", "initech")), st.booleans()),
    st.tuples(st.just("run"), st.integers(1, 20)),
)
#: Disruptions of the watch. Rarer than changes: a re-list repairs everything before it,
#: so a history made mostly of cuts would hide a watch path that loses events.
disruptions = st.one_of(
    st.tuples(st.just("cut")),
    st.tuples(st.just("end")),
    st.tuples(st.just("compact")),
)
operations = st.one_of(changes, changes, changes, changes, disruptions)
Op = tuple[Any, ...]


@dataclass
class World:
    kube: KubeEmulator
    core: k8s.CoreV1Api
    keys: Resolver
    sub: KubernetesSubstrate


def name(i: int) -> str:
    return f"p{i}"


async def apply(world: World, op: Op) -> None:
    kube, core = world.kube, world.core
    kind = op[0]
    pod = kube.pod(NS, name(op[1])) if len(op) > 1 and isinstance(op[1], int) else None
    if kind == "create" and pod is None:
        _, i, client, warm = op
        labels = {LABEL_TIER: "default", LABEL_MANAGED_BY: MANAGED_BY}
        if warm:
            labels[LABEL_POOL] = "warm"
        else:
            labels[LABEL_SANDBOX_ID] = f"s{i}"
            if client is not None:
                labels[LABEL_CLIENT_ID] = client
        body: Any = {"metadata": {"name": name(i), "labels": labels}, "spec": _spec()}
        await core.create_namespaced_pod(NS, body)
    elif kind == "relabel" and pod is not None:
        # an out-of-band change (kubectl label --overwrite): the reflector must follow it
        await core.patch_namespaced_pod(
            name(op[1]), NS, {"metadata": {"labels": {LABEL_CLIENT_ID: op[2]}}}
        )
    elif kind == "adopt" and pod is not None:
        patch: Any = {
            "metadata": {
                "labels": {LABEL_SANDBOX_ID: f"s{op[1]}", LABEL_POOL: None, LABEL_CLIENT_ID: op[2]}
            }
        }
        await core.patch_namespaced_pod(name(op[1]), NS, patch)
    elif kind in ("unmanage", "manage") and pod is not None:
        value = MANAGED_BY if kind == "manage" else None
        await core.patch_namespaced_pod(
            name(op[1]), NS, {"metadata": {"labels": {LABEL_MANAGED_BY: value}}}
        )
    elif kind == "phase" and pod is not None:
        kube.set_pod_phase(NS, name(op[1]), op[2])
    elif kind == "terminate" and pod is not None:
        kube.mutate_pod(
            NS,
            name(op[1]),
            lambda p: p["metadata"].update({"deletionTimestamp": "2026-11-29T00:00:00Z"}),
        )
    elif kind == "delete" and pod is not None:
        await core.delete_namespaced_pod(name(op[1]), NS)
    elif kind == "cut":
        kube.cut_watches()
    elif kind == "end":
        kube.end_watches()
    elif kind == "compact":
        kube.compact()
    elif kind == "keyset":
        _, client, allow = op
        keyset = world.keys.keyset
        world.keys.swap(
            keyset.changed(allow=[client]) if allow else keyset.changed(remove=[client])
        )
    elif kind == "run":
        for _ in range(op[1]):
            await asyncio.sleep(0)


def _spec() -> dict[str, Any]:
    return {"containers": [{"name": "runtime", "image": "runtime"}]}


def truth(world: World) -> tuple[Counter[str], Counter[str | None], dict[str, str], set[str]]:
    """Per-key and per-client live counts, each live sandbox's key, and the warm pods,
    from the emulator's pods and the current key set, independently of the index."""
    by_key: Counter[str] = Counter()
    by_client: Counter[str | None] = Counter()
    key_of: dict[str, str] = {}
    warm: set[str] = set()
    for obj in world.kube.pods(NS):
        meta = obj["metadata"]
        labels = meta.get("labels") or {}
        finished = (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if labels.get(LABEL_MANAGED_BY) != MANAGED_BY or meta.get("deletionTimestamp") or finished:
            continue
        if LABEL_SANDBOX_ID in labels:
            client = labels.get(LABEL_CLIENT_ID)
            key = world.keys.resolve_label(client).key
            by_key[key] += 1
            by_client[client] += 1
            key_of[labels[LABEL_SANDBOX_ID]] = key
        elif LABEL_POOL in labels:
            warm.add(meta["name"])
    return by_key, by_client, key_of, warm


async def settle(world: World) -> None:
    """Wait until the reflector has applied everything the emulator holds."""
    reflector, kube = world.sub.reflector, world.kube
    await reflector.wait_until(lambda: reflector.resource_version == str(kube.resource_version), 10)


def check(world: World) -> None:
    by_key, by_client, key_of, warm = truth(world)
    index = world.sub.index
    assert index.count_by_key() == dict(by_key)
    assert index.count_by_client() == dict(by_client)
    assert {p.name for p in index.warm("default")} == warm
    sandboxes = [f"s{i}" for i in range(PODS)]
    for key in KEYS:
        exclude = next((s for s, k in key_of.items() if k == key), None)
        expected_pending = frozenset(s for s, k in key_of.items() if k == key and s != exclude)
        assert world.sub.count_live(key, exclude, sandboxes) == LiveCount(
            by_key[key] - (1 if exclude else 0), expected_pending
        )


async def scenario(ops: list[Op], *, checkpoint_every: int = 0) -> int:
    """Run ``ops``; check after settling (and every ``checkpoint_every`` ops). Returns lists."""
    async with KubeEmulator(bookmark_interval=0.02) as kube:
        keys = Resolver(KeySet(version=1, allowlist=frozenset({"acme", "globex"})))
        sub = KubernetesSubstrate(
            KubernetesSettings(
                api_host=kube.url,
                namespace=NS,
                relist_backoff_s=0.001,
                relist_backoff_max_s=0.01,
                list_page_size=5,
            ),
            keys,
        )
        api = kube.api_client()
        try:
            await sub.start()
            await sub.pool.stop()  # the warm-pool loop would write pods of its own
            await sub.wait_synced(5)
            world = World(kube, k8s.CoreV1Api(api), keys, sub)
            for n, op in enumerate(ops, 1):
                await apply(world, op)
                if checkpoint_every and n % checkpoint_every == 0:
                    await settle(world)
                    check(world)
            await settle(world)
            check(world)
            return sub.reflector.lists
        finally:
            await sub.close()
            await api.close()


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
)
@given(ops=st.lists(operations, min_size=20, max_size=80))
def test_reflector_converges_to_the_api_servers_truth_after_any_history(ops: list[Op]) -> None:
    asyncio.run(scenario(ops, checkpoint_every=8))


@pytest.mark.slow
@pytest.mark.timeout(600)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operations, min_size=400, max_size=1500))
def test_reflector_never_drifts_over_long_histories(ops: list[Op]) -> None:
    asyncio.run(scenario(ops, checkpoint_every=50))


def test_a_long_chaotic_history_relists_and_still_matches() -> None:
    """A fixed long history with many cuts and compactions: the re-list path is exercised
    and counts end exact (the fast suite's guard against drift)."""
    ops: list[Op] = []
    for round_ in range(30):
        for i in range(PODS):
            ops.append(("create", i, CLIENTS[(i + round_) % len(CLIENTS)], i % 5 == 0))
        ops += [("relabel", round_ % PODS, CLIENTS[round_ % len(CLIENTS)]), ("run", 3)]
        ops += [("end",), ("phase", (round_ + 1) % PODS, "Succeeded"), ("compact",)]
        ops += [("unmanage", (round_ + 2) % PODS), ("cut",), ("manage", (round_ + 2) % PODS)]
        ops += [("keyset", "initech", round_ % 2 == 0), ("run", 5)]
        ops += [("delete", (round_ + 3) % PODS), ("terminate", (round_ + 4) % PODS)]
        ops += [("delete", (round_ + 4) % PODS)]
    lists = asyncio.run(scenario(ops, checkpoint_every=len(ops) // 10))
    assert lists > 5
