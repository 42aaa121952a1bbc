"""The leader's sweeps (SPEC F4) against the API-server emulator and a real PostgreSQL:
orphan, finished and expired warm pods are removed; records whose pod is gone are ended (or
follow the sandbox's other live pod); a dry run changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from turnstile_platform.leader import LocalLeadership
from turnstile_substrate.db import claims, records
from turnstile_substrate.db.claims import Claim
from turnstile_substrate.kubernetes import KubernetesSubstrate, add_sweeps, template
from turnstile_substrate.kubernetes.sweeps import (
    EXPIRED_WARM,
    FINISHED,
    GONE,
    GONE_WATCH,
    ORPHANS,
    Sweeper,
)
from turnstile_substrate.locks import SandboxClaims
from turnstile_substrate.runtime import CreateKind, Plan, Runtime, RuntimeSpec
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kubectl import KUBECTL, run_kubectl

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"
LONG_AGO = "2020-01-01T00:00:00Z"


class Released(list[str]):
    """The admission release the sweeps call; ``called`` is set by the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.called = asyncio.Event()

    async def __call__(self, sandbox_id: str) -> None:
        self.append(sandbox_id)
        self.called.set()


def swept(sweep: str, action: str) -> float:
    """``turnstile_substrate_sweep_total{sweep, action}`` so far (the registry is global)."""
    labels = {"sweep": sweep, "action": action}
    return REGISTRY.get_sample_value("turnstile_substrate_sweep_total", labels) or 0.0


@contextlib.asynccontextmanager
async def leading(
    sub: KubernetesSubstrate, pool: asyncpg.Pool, released: Released, leadership: LocalLeadership
) -> AsyncIterator[None]:
    """The app's leader-only sweeps (the passes and the gone-runtime watch) running."""
    watch = add_sweeps(sub, leadership, pool, released, 5.0)
    task = asyncio.create_task(leadership.run())
    try:
        await asyncio.wait_for(watch.watching.wait(), 10)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def no_gate() -> None:
    return None


def spec(sandbox: str) -> RuntimeSpec:
    return RuntimeSpec(sandbox, "default", "acme")


async def record(pool: asyncpg.Pool, sandbox: str, pod: str) -> None:
    runtime = Runtime(sandbox, pod, CreateKind.COLD, "acme", "default")
    async with pool.acquire() as conn:
        await records.record_activation(
            conn, runtime, substrate="kubernetes", charged_key="acme", receipt=None
        )


async def execution(pool: asyncpg.Pool, sandbox: str) -> Any:
    async with pool.acquire() as conn:
        return await records.fetch_sandbox(conn, sandbox)


def age(kube: KubeEmulator, name: str, when: str = LONG_AGO) -> None:
    kube.mutate_pod(NS, name, lambda p: p["metadata"].update(creationTimestamp=when))


async def caught_up(sub: KubernetesSubstrate, kube: KubeEmulator) -> None:
    reflector = sub.reflector
    await reflector.wait_until(lambda: reflector.resource_version == str(kube.resource_version), 5)


async def recorded_then_deleted(
    sub: KubernetesSubstrate, kube: KubeEmulator, pool: asyncpg.Pool, sandbox: str
) -> Runtime:
    """A recorded sandbox pod deleted outside Turnstile (kubectl delete, an eviction, a node
    lost), once the cache has seen it go."""
    runtime = await sub.ensure_runtime(spec(sandbox), Plan(CreateKind.COLD), no_gate)
    await record(pool, sandbox, runtime.name)
    kube.delete_pod(NS, runtime.name)
    await caught_up(sub, kube)
    return runtime


def sweeper(sub: KubernetesSubstrate, pool: asyncpg.Pool, released: Released) -> Sweeper:
    return sub.sweeper(pool, released)


async def test_a_pod_no_record_names_is_removed_after_the_grace(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    async with substrate(kube, sweep_orphan_grace_s=60) as sub:
        # a create that landed after its client timed out: nothing recorded it
        orphan = await sub.ensure_runtime(spec("lost"), Plan(CreateKind.COLD), no_gate)
        kept = await sub.ensure_runtime(spec("kept"), Plan(CreateKind.COLD), no_gate)
        await record(pool, "kept", kept.name)
        young = await sub.ensure_runtime(spec("young"), Plan(CreateKind.COLD), no_gate)
        age(kube, orphan.name)
        age(kube, kept.name)
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, Released()).sweep_once()

    assert kube.pod(NS, orphan.name) is None
    assert kube.pod(NS, kept.name) is not None
    assert kube.pod(NS, young.name) is not None  # within the grace: maybe an activation in flight
    assert report.get(ORPHANS, "found") == 1
    assert report.get(ORPHANS, "removed") == 1


async def test_an_unrecorded_pod_whose_activation_still_holds_its_claim_is_kept(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    async with substrate(kube, sweep_orphan_grace_s=60) as sub:
        slow = await sub.ensure_runtime(spec("slow"), Plan(CreateKind.COLD), no_gate)
        age(kube, slow.name)
        async with pool.acquire() as conn:  # its activation is still under way
            assert await claims.try_claim(conn, Claim("slow", "replica/1/a"), 60)
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, Released()).sweep_once()

        assert kube.pod(NS, slow.name) is not None
        assert report.get(ORPHANS, "removed") == 0

        async with pool.acquire() as conn:  # that activation died: its claim lapses
            await conn.execute(
                "UPDATE activation_claims SET expires_at = clock_timestamp() - interval '1 s'"
            )
        report = await sweeper(sub, pool, Released()).sweep_once()

    assert kube.pod(NS, slow.name) is None
    assert report.get(ORPHANS, "removed") == 1


async def test_failed_and_succeeded_pods_are_removed(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    async with substrate(kube) as sub:
        failed = await sub.ensure_runtime(spec("f"), Plan(CreateKind.COLD), no_gate)
        done = await sub.ensure_runtime(spec("d"), Plan(CreateKind.COLD), no_gate)
        running = await sub.ensure_runtime(spec("r"), Plan(CreateKind.COLD), no_gate)
        kube.set_pod_phase(NS, failed.name, "Failed")
        kube.set_pod_phase(NS, done.name, "Succeeded")
        kube.set_pod_phase(NS, running.name, "Running")
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, Released()).sweep_once()

    assert kube.pod(NS, failed.name) is None
    assert kube.pod(NS, done.name) is None
    assert kube.pod(NS, running.name) is not None
    assert report.get(FINISHED, "removed") == 2


async def test_warm_pods_past_their_maximum_age_are_replaced(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    async with substrate(
        kube, tier_runtimes={"default": {"warm_pool_size": 2}}, sweep_warm_max_age_s=600
    ) as sub:
        await sub.reflector.wait_until(lambda: sum(1 for _ in sub.index.warm("default")) == 2, 5)
        old, fresh = sorted(p.name for p in sub.index.warm("default"))
        age(kube, old)
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, Released()).sweep_once()
        # the refill makes a new one in its place
        await sub.reflector.wait_until(
            lambda: (
                sorted(p.name for p in sub.index.warm("default")) != [old, fresh]
                and sum(1 for _ in sub.index.warm("default")) == 2
            ),
            5,
        )

    assert kube.pod(NS, old) is None
    assert kube.pod(NS, fresh) is not None
    assert report.get(EXPIRED_WARM, "removed") == 1


async def test_a_pod_deleted_outside_turnstile_ends_its_execution(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    released = Released()
    async with substrate(kube) as sub:
        await recorded_then_deleted(sub, kube, pool, "s1")

        report = await sweeper(sub, pool, released).sweep_once()

    sandbox = await execution(pool, "s1")
    assert sandbox.state == "stopped"
    assert sandbox.execution is None
    assert released == ["s1"]
    assert report.get(GONE, "removed") == 1
    async with pool.acquire() as conn:
        reason = await conn.fetchval("SELECT end_reason FROM executions WHERE sandbox_id = 's1'")
    assert reason == "runtime_gone"


async def ended_reason(pool: asyncpg.Pool, sandbox: str) -> str | None:
    async with pool.acquire() as conn:
        reason: str | None = await conn.fetchval(
            "SELECT end_reason FROM executions WHERE sandbox_id = $1 AND ended_at IS NOT NULL",
            sandbox,
        )
    return reason


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
async def test_a_pod_kubectl_deletes_ends_its_execution_at_once_not_at_the_next_sweep(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool, tmp_path: Path
) -> None:
    released, leadership = Released(), LocalLeadership()
    # one pass when leading starts, the next an hour later: only the prompt path can end it
    async with substrate(kube, leadership=leadership, sweep_interval_s=3600) as sub:
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
        await record(pool, "s1", runtime.name)
        kube.set_pod_phase(NS, runtime.name, "Running")
        kept = await sub.ensure_runtime(spec("s2"), Plan(CreateKind.COLD), no_gate)
        await record(pool, "s2", kept.name)
        by_watch, by_pass = swept(GONE_WATCH, "removed"), swept(GONE, "removed")
        async with leading(sub, pool, released, leadership):
            code, _, err = await run_kubectl(
                kube.url, tmp_path, NS, "delete", "pod", runtime.name, "--wait=false"
            )
            assert code == 0, err
            await asyncio.wait_for(released.called.wait(), 10)

    assert released == ["s1"]
    assert await ended_reason(pool, "s1") == "runtime_gone"
    assert (await execution(pool, "s1")).state == "stopped"
    assert (await execution(pool, "s2")).execution is not None  # its pod still runs
    assert swept(GONE_WATCH, "removed") - by_watch == 1
    assert swept(GONE, "removed") == by_pass


async def test_a_pod_seen_to_go_twice_or_already_ended_changes_nothing(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    released = Released()
    async with substrate(kube) as sub:
        runtime = await recorded_then_deleted(sub, kube, pool, "s1")
        ender = sweeper(sub, pool, released)
        first = await ender.end_if_recorded("s1", runtime.name)
        again = await ender.end_if_recorded("s1", runtime.name)
        never = await ender.end_if_recorded("s2", "ts-s2-000000")

    assert first.get(GONE_WATCH, "removed") == 1
    assert again.counts == {}
    assert never.counts == {}
    assert released == ["s1"]


async def test_a_pod_a_deactivate_is_stopping_keeps_the_deactivates_end_reason(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    released = Released()
    async with substrate(kube) as sub:
        # a Deactivate in progress: it holds the sandbox's activation claim, has deleted the
        # pod (which is how the watch hears of it), and ends the row itself before it lets go
        deactivation = SandboxClaims(pool, ttl_s=10, max_s=10, database_timeout_s=1.0)
        async with deactivation.hold("s1", 1.0):
            runtime = await recorded_then_deleted(sub, kube, pool, "s1")
            ender = sub.sweeper(pool, released, database_timeout_s=0.2)
            waited = await ender.end_if_recorded("s1", runtime.name)
            async with pool.acquire() as deactivate:
                await records.end_execution(deactivate, "s1", reason="deactivated")
        after = await ender.end_if_recorded("s1", runtime.name)

    assert waited.get(GONE_WATCH, "error") == 1  # the claim was held: left alone
    assert after.counts == {}
    assert await ended_reason(pool, "s1") == "deactivated"
    assert released == []


async def test_a_deleted_pod_whose_sandbox_has_another_live_pod_moves_the_record_at_once(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    released = Released()
    async with substrate(kube) as sub:
        first = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
        await record(pool, "s1", first.name)
        # a second pod of the sandbox (a replacement that overlapped, say)
        body = template.sandbox_pod(
            sub.settings, RuntimeSpec("s1", "default", "acme", generation=1)
        )
        kube.create_pod(NS, body)
        kube.delete_pod(NS, first.name)
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, released).end_if_recorded("s1", first.name)

    sandbox = await execution(pool, "s1")
    assert sandbox.execution is not None
    assert sandbox.execution.runtime_name == body["metadata"]["name"]
    assert report.get(GONE_WATCH, "adopted") == 1
    assert released == []


async def test_a_record_whose_pod_is_gone_follows_the_sandboxs_other_live_pod(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    async with substrate(kube) as sub:
        await record(pool, "s1", "ts-s1-vanished")  # its pod is long gone
        other = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
        age(kube, other.name)
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, Released()).sweep_once()

    sandbox = await execution(pool, "s1")
    assert sandbox.state == "running"
    assert sandbox.execution.runtime_name == other.name
    assert kube.pod(NS, other.name) is not None  # adopted, not swept as an orphan
    assert report.get(GONE, "adopted") == 1
    assert report.get(ORPHANS, "found") == 0


async def test_a_record_of_a_pod_the_cache_has_not_seen_yet_is_kept(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    async with substrate(kube) as sub:
        body = template.sandbox_pod(sub.settings, spec("s1"))
        await sub.reflector.stop()  # the cache stops following the API server
        kube.create_pod(NS, body)
        await record(pool, "s1", body["metadata"]["name"])

        report = await sweeper(sub, pool, Released()).sweep_once()

    assert report.get(GONE, "found") == 0
    assert (await execution(pool, "s1")).state == "running"


async def test_a_dry_run_counts_and_changes_nothing(
    kube: KubeEmulator, substrate: StartSubstrate, pool: asyncpg.Pool
) -> None:
    released = Released()
    async with substrate(kube, sweep_dry_run=True, sweep_orphan_grace_s=0) as sub:
        orphan = await sub.ensure_runtime(spec("lost"), Plan(CreateKind.COLD), no_gate)
        failed = await sub.ensure_runtime(spec("f"), Plan(CreateKind.COLD), no_gate)
        kube.set_pod_phase(NS, failed.name, "Failed")
        await record(pool, "gone", "ts-gone-pod")
        await caught_up(sub, kube)

        report = await sweeper(sub, pool, released).sweep_once()

    assert report.get(ORPHANS, "found") == 1
    assert report.get(FINISHED, "found") == 1
    assert report.get(GONE, "found") == 1
    assert not any(action in ("removed", "adopted") for _, action in report.counts)
    assert kube.pod(NS, orphan.name) is not None
    assert kube.pod(NS, failed.name) is not None
    assert (await execution(pool, "gone")).state == "running"
    assert released == []
