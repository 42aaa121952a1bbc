"""The fair-share seats on their own (SPEC N1): assured shares, borrowing and giving
back, fair queuing across flows, queue bounds in length and time, the refusal's
details, and a waiting call that is cancelled leaving its queue at once."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from turnstile_platform.errors import RichError
from turnstile_platform.fair_share import REFUSED, FlowId, Level, Seat, Seats

SHARES = {Level.PLATFORM: 30, Level.TENANTS: 40, Level.PLACEMENTS: 20, Level.WORKERS: 10}


def seats(total: int = 10, queue_length: int = 2, queue_wait_s: float = 30.0) -> Seats:
    return Seats(
        "unary",
        total,
        SHARES,
        queue_length=queue_length,
        queue_wait_s=queue_wait_s,
        retry_after_s=0.5,
    )


def tenant(name: str) -> FlowId:
    return FlowId(Level.TENANTS, f"spiffe://t/client/{name}", name, "spiffe://t/client/*")


PLATFORM = FlowId(Level.PLATFORM, "spiffe://t/service/substrate", "acme", "spiffe://t/service/x")


def take_all(pool: Seats, flow: FlowId) -> list[Seat]:
    """Every seat ``flow`` can take at once."""
    held = []
    while (seat := pool.try_take(flow)) is not None:
        held.append(seat)
    return held


async def waiting(pool: Seats, flow: FlowId, count: int) -> list[asyncio.Task[Seat]]:
    """``count`` calls of ``flow`` waiting for a seat (their tasks)."""
    tasks = [asyncio.ensure_future(pool.take(flow, "Get")) for _ in range(count)]
    await asyncio.sleep(0)  # one turn of the loop: each task runs up to its wait
    assert pool.waiting >= count
    return tasks


def test_assured_seats_are_the_levels_shares_of_the_total() -> None:
    pool = seats(total=100)
    assert {level: pool.assured(level) for level in Level} == {
        Level.PLATFORM: 30,
        Level.TENANTS: 40,
        Level.PLACEMENTS: 20,
        Level.WORKERS: 10,
    }


def test_a_lone_flow_borrows_every_idle_seat_up_to_the_total() -> None:
    pool = seats(total=10)
    held = take_all(pool, tenant("acme"))
    assert len(held) == 10  # 4 assured to tenants, 6 borrowed from idle levels
    assert pool.level_in_flight(Level.TENANTS) == 10


def test_a_platform_call_is_never_refused_while_a_tenant_holds_every_seat() -> None:
    pool = seats(total=10)
    take_all(pool, tenant("acme"))
    # The platform level takes back its 3 assured seats from the borrower at once.
    platform = [pool.take_now(PLATFORM, "Admit") for _ in range(3)]
    assert len(platform) == 3
    assert pool.in_flight == 13


def test_borrowed_seats_go_back_to_the_lender_as_the_borrowers_calls_end() -> None:
    pool = seats(total=10)
    held = take_all(pool, tenant("acme"))
    # Past the level's own seats, a borrower gets no new seat while the replica is full…
    assert pool.try_take(tenant("acme")) is None
    for seat in held[:5]:
        pool.release(seat)
    # …and, with room again, the platform's calls find theirs.
    platform = take_all(pool, PLATFORM)
    assert len(platform) >= 3


def test_a_second_tenant_gets_its_fair_share_while_the_first_holds_every_seat() -> None:
    pool = seats(total=10)
    take_all(pool, tenant("acme"))
    # Two flows in the tenants level: 4 assured seats, 2 each.
    globex = [pool.take_now(tenant("globex"), "GetUsage") for _ in range(2)]
    assert len(globex) == 2
    # Past its share with no room, its next call is not seated at once.
    assert pool.try_take(tenant("globex")) is None


async def test_a_flow_past_its_share_waits_in_its_own_queue_and_is_refused_past_its_length() -> (
    None
):
    pool = seats(total=10, queue_length=2)
    held = take_all(pool, tenant("acme"))
    tasks = await waiting(pool, tenant("acme"), 2)
    before = REFUSED.labels("unary", "tenants", "queue_full", "spiffe://t/client/*")._value.get()
    with pytest.raises(RichError) as raised:
        await pool.take(tenant("acme"), "ListDecisions")
    error = raised.value
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "CONCURRENCY_LIMITED"
    assert error.retry_after_s == 0.5
    assert error.metadata["flow"] == "spiffe://t/client/acme for acme"
    assert error.metadata["level"] == "tenants"
    assert error.metadata["level_limit"] == "4"
    assert error.metadata["limit"] == "10"
    assert error.metadata["method"] == "ListDecisions"
    assert error.metadata["why"] == "queue_full"
    after = REFUSED.labels("unary", "tenants", "queue_full", "spiffe://t/client/*")._value.get()
    assert after == before + 1
    # Another tenant is not refused for it: its share is seated at once.
    assert pool.try_take(tenant("globex")) is not None
    # Seats freed go back below the total (globex's took it past), then to the
    # waiting calls, first come first served in the flow's queue.
    pool.release(held[0])
    assert not tasks[0].done()
    pool.release(held[1])
    seated = await tasks[0]
    assert seated.id == tenant("acme")
    assert not tasks[1].done()
    assert pool.level_waiting(Level.TENANTS) == 1
    tasks[1].cancel()


async def test_a_call_waiting_past_the_queue_wait_is_refused() -> None:
    pool = seats(total=10, queue_wait_s=0.05)
    take_all(pool, tenant("acme"))
    with pytest.raises(RichError) as raised:
        await pool.take(tenant("acme"), "GetUsage")
    assert raised.value.metadata["why"] == "waited"
    assert pool.waiting == 0
    assert pool.level_waiting(Level.TENANTS) == 0


async def test_no_queue_refuses_at_once() -> None:
    pool = seats(total=10, queue_length=0)
    take_all(pool, tenant("acme"))
    with pytest.raises(RichError):
        await pool.take(tenant("acme"), "GetUsage")
    assert pool.waiting == 0


async def test_a_cancelled_waiting_call_leaves_its_queue_at_once() -> None:
    pool = seats(total=10, queue_length=2)
    held = take_all(pool, tenant("acme"))
    first, second = await waiting(pool, tenant("acme"), 2)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert pool.waiting == 1
    assert pool.level_waiting(Level.TENANTS) == 1
    # Its place is free: one more call may wait, and the freed seat goes to the
    # call still waiting, not to the cancelled one.
    third = asyncio.ensure_future(pool.take(tenant("acme"), "Get"))
    await asyncio.sleep(0)
    assert pool.waiting == 2
    pool.release(held[0])
    assert (await second).id == tenant("acme")
    assert pool.in_flight == 10
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third
    assert pool.waiting == 0


async def test_a_call_cancelled_as_it_is_seated_gives_its_seat_back() -> None:
    pool = seats(total=10)
    held = take_all(pool, tenant("acme"))
    (task,) = await waiting(pool, tenant("acme"), 1)
    pool.release(held[0])  # seats the waiter: its task has not run yet
    assert pool.in_flight == 10
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.in_flight == 9


async def test_freed_seats_go_to_the_waiting_flow_holding_fewest() -> None:
    pool = seats(total=4, queue_length=4)
    # Tenants' 2 assured seats and every idle one: acme holds 4.
    acme = take_all(pool, tenant("acme"))
    assert len(acme) == 4
    acme_waiting = await waiting(pool, tenant("acme"), 2)
    globex_seat = pool.try_take(tenant("globex"))  # its share: 2 // 2 = 1
    assert globex_seat is not None
    globex_waiting = asyncio.ensure_future(pool.take(tenant("globex"), "Get"))
    await asyncio.sleep(0)
    assert pool.waiting == 3
    # Over the total now; a freed seat goes back first, the next to globex (1 held)
    # before acme (2 held by then), though acme's calls waited longer.
    pool.release(acme[0])
    await asyncio.sleep(0)
    assert not globex_waiting.done()
    pool.release(acme[1])
    assert (await globex_waiting).id == tenant("globex")
    assert not any(task.done() for task in acme_waiting)
    for task in acme_waiting:
        task.cancel()


async def test_the_platform_level_keeps_its_seats_while_tenants_flood() -> None:
    """Many tenant flows flood with every call they may queue: each platform call,
    as many as its level is assured, is seated at once, none refused."""
    pool = seats(total=20, queue_length=3)
    tasks: list[asyncio.Task[Seat]] = []
    for n in range(6):
        take_all(pool, tenant(f"t{n}"))
        tasks += [asyncio.ensure_future(pool.take(tenant(f"t{n}"), "Get")) for _ in range(5)]
    await asyncio.sleep(0)
    assert pool.level_in_flight(Level.TENANTS) >= 20
    refused = [t for t in tasks if t.done() and isinstance(t.exception(), RichError)]
    assert refused  # the tenants' own excess
    platform = [pool.take_now(PLATFORM, "Admit") for _ in range(pool.assured(Level.PLATFORM))]
    assert len(platform) == 6
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert pool.waiting == 0


def test_flows_are_forgotten_once_they_hold_and_wait_for_nothing() -> None:
    pool = seats(total=10)
    seat = pool.take_now(tenant("acme"), "Get")
    assert pool.level_flows(Level.TENANTS) == 1
    pool.release(seat)
    assert pool.level_flows(Level.TENANTS) == 0
