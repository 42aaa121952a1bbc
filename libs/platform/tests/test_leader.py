"""Leader election over a Lease in the API-server emulator, each elector on its own connection
(through its own proxy, so one can be cut off while the others keep talking)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from turnstile_platform.leader import LeaderElector, LeaderTerm, LocalLeadership
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.tcp_proxy import TcpProxy

NS = "turnstile"
LEASE = "test-leader"
DURATION_S = 3.0
RENEW_S = 2.0
RETRY_S = 0.25


@dataclass
class Journal:
    """What the leader-only work saw, in the order it happened (one event loop: a total order)."""

    events: list[tuple[str, str, int]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, kind: str, term: LeaderTerm) -> None:
        self.events.append((kind, term.identity, term.epoch))
        self.changed.set()

    async def wait_for(self, count: int, kind: str = "start") -> None:
        async with asyncio.timeout(30):
            while sum(1 for e in self.events if e[0] == kind) < count:
                self.changed.clear()
                await self.changed.wait()

    def starts(self) -> list[tuple[str, str, int]]:
        return [e for e in self.events if e[0] == "start"]


@dataclass
class Replica:
    elector: LeaderElector
    proxy: TcpProxy
    task: asyncio.Task[None]

    @property
    def identity(self) -> str:
        return self.elector.identity


@pytest.fixture
async def kube() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator() as emulator:
        yield emulator


@pytest.fixture
async def replicas(kube: KubeEmulator) -> AsyncIterator[tuple[list[Replica], Journal]]:
    journal = Journal()
    started: list[Replica] = []
    async with contextlib.AsyncExitStack() as stack:
        for i in range(3):
            proxy = await stack.enter_async_context(TcpProxy("127.0.0.1", kube.port))
            from kubernetes_asyncio.client import ApiClient, Configuration

            api = await stack.enter_async_context(ApiClient(Configuration(host=proxy.url)))
            elector = LeaderElector(
                api,
                namespace=NS,
                lease_name=LEASE,
                identity=f"replica-{i}",
                lease_duration_s=DURATION_S,
                renew_deadline_s=RENEW_S,
                retry_period_s=RETRY_S,
            )

            async def work(term: LeaderTerm) -> None:
                journal.add("start", term)
                try:
                    await asyncio.Event().wait()
                finally:
                    journal.add("stop", term)

            elector.add_work("journal", work)
            task = asyncio.create_task(elector.run())
            started.append(Replica(elector, proxy, task))
        try:
            yield started, journal
        finally:
            for replica in started:
                replica.proxy.restore()
                replica.task.cancel()
            await asyncio.gather(*(r.task for r in started), return_exceptions=True)


def leaders(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.elector.is_leader]


async def test_exactly_one_of_three_electors_leads(
    kube: KubeEmulator, replicas: tuple[list[Replica], Journal]
) -> None:
    group, journal = replicas
    await journal.wait_for(1)
    # Let every candidate try a few more times against the held lease.
    await asyncio.sleep(4 * RETRY_S)

    assert len(leaders(group)) == 1
    assert len(journal.starts()) == 1
    lease = kube.lease(NS, LEASE)
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == leaders(group)[0].identity


async def test_a_dead_leader_is_replaced_by_exactly_one_within_the_lease_duration(
    kube: KubeEmulator, replicas: tuple[list[Replica], Journal]
) -> None:
    group, journal = replicas
    await journal.wait_for(1)
    old = leaders(group)[0]

    # A crash: the process stops and never releases its lease (its network is gone too).
    old.proxy.blackhole()
    died = time.monotonic()
    old.task.cancel()
    await asyncio.gather(old.task, return_exceptions=True)
    await journal.wait_for(2)
    took = time.monotonic() - died

    new = leaders(group)
    assert len(new) == 1
    assert new[0] is not old
    # Expiry is counted from the last renewal others saw, then one retry period to notice.
    assert took <= DURATION_S + 2 * RETRY_S + 4.0  # slack for a loaded machine
    assert [e[2] for e in journal.starts()] == sorted({e[2] for e in journal.starts()})


async def test_a_leader_that_cannot_renew_stops_its_work_before_another_starts(
    kube: KubeEmulator, replicas: tuple[list[Replica], Journal]
) -> None:
    group, journal = replicas
    await journal.wait_for(1)
    old = leaders(group)[0]

    old.proxy.blackhole()  # still running, but its renewals hang
    await journal.wait_for(2)

    stop_old = journal.events.index(("stop", old.identity, journal.starts()[0][2]))
    start_new = journal.events.index(journal.starts()[1])
    assert stop_old < start_new, journal.events
    assert not old.elector.is_leader
    assert journal.starts()[1][1] != old.identity


async def test_the_epoch_increases_with_every_change_of_holder(
    kube: KubeEmulator, replicas: tuple[list[Replica], Journal]
) -> None:
    group, journal = replicas
    for round_ in range(1, 3):
        await journal.wait_for(round_)
        leader = leaders(group)[0]
        leader.task.cancel()  # a graceful exit releases the lease at once
        await asyncio.gather(leader.task, return_exceptions=True)
    await journal.wait_for(3)

    epochs = [e[2] for e in journal.starts()]
    assert epochs == sorted(epochs)
    assert len(set(epochs)) == 3
    holders = [e[1] for e in journal.starts()]
    assert len(set(holders)) == 3
    lease = kube.lease(NS, LEASE)
    assert lease is not None
    assert lease["spec"]["leaseTransitions"] == epochs[-1]


async def test_a_released_lease_is_taken_without_waiting_for_expiry(
    kube: KubeEmulator, replicas: tuple[list[Replica], Journal]
) -> None:
    group, journal = replicas
    await journal.wait_for(1)
    old = leaders(group)[0]

    old.task.cancel()
    await asyncio.gather(old.task, return_exceptions=True)
    released = kube.lease(NS, LEASE)
    await journal.wait_for(2)

    assert released is not None
    assert released["spec"].get("holderIdentity") in (None, "")
    assert ("stop", old.identity, journal.starts()[0][2]) in journal.events


async def test_work_that_fails_is_restarted_while_leading(kube: KubeEmulator) -> None:
    runs: list[int] = []
    third = asyncio.Event()

    async def flaky(term: LeaderTerm) -> None:
        runs.append(term.epoch)
        if len(runs) >= 3:
            third.set()
            await asyncio.Event().wait()
        raise RuntimeError("boom")

    async with kube.api_client() as api:
        elector = LeaderElector(
            api,
            namespace=NS,
            lease_name="flaky",
            identity="solo",
            lease_duration_s=DURATION_S,
            renew_deadline_s=RENEW_S,
            retry_period_s=RETRY_S,
        )
        elector.add_work("flaky", flaky)
        task = asyncio.create_task(elector.run())
        try:
            async with asyncio.timeout(30):
                await third.wait()
            assert elector.is_leader
            assert runs == [0, 0, 0]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_local_leadership_always_leads_with_epoch_one() -> None:
    local = LocalLeadership()
    seen: asyncio.Queue[LeaderTerm] = asyncio.Queue()

    async def work(term: LeaderTerm) -> None:
        await seen.put(term)
        await asyncio.Event().wait()

    local.add_work("w", work)
    task = asyncio.create_task(local.run())
    term = await asyncio.wait_for(seen.get(), 10)
    assert term.epoch == 1
    assert local.is_leader
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not local.is_leader


def test_periods_must_nest() -> None:
    with pytest.raises(ValueError, match="retry_period_s < renew_deadline_s"):
        LeaderElector(
            object(),  # type: ignore[arg-type]
            namespace=NS,
            lease_name=LEASE,
            identity="x",
            lease_duration_s=2,
            renew_deadline_s=2,
            retry_period_s=1,
        )
