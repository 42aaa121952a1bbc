"""A PostgreSQL switchover under steady activations (SPEC F3, F7, X6).

The substrate (Kubernetes, on the API-server emulator) and the real admission service
run in this process over real gRPC sockets; the substrate's database URL names a
primary and its streaming standby with ``target_session_attrs=read-write``. While
workers activate, read and deactivate sandboxes, the primary is stopped
(``pg_ctl stop -m fast``) and the standby promoted (``pg_ctl promote``). Every call
answers within its bound, with success or UNAVAILABLE and a retry hint (never
INTERNAL, never a hang); after the switch calls succeed against the new primary
without a restart; no committed activation is lost; and once the TTLs have passed
nothing is left in admission and the live set equals the pods.

The figures (the gap with no successful write against the switchover's own duration,
the answers by class) are printed: run with ``-s``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis.asyncio as aioredis

from turnstile_testing.replication import PostgresPair, Switchover

from .invariants import live_pods, settled
from .pg_load import (
    STEADY_S,
    WORKERS,
    Load,
    Stack,
    check_answers,
    deactivate_all,
    first_write_after,
    running_stack,
    write_gaps,
)

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.fixture
async def stack(
    postgres_pair: PostgresPair,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Stack]:
    async with running_stack(postgres_pair, redis_url, redis_prefix, monkeypatch) as stack:
        yield stack


async def test_a_switchover_under_load_answers_every_call_retryably_and_loses_nothing(
    stack: Stack, redis: aioredis.Redis, redis_prefix: str
) -> None:
    loop = asyncio.get_running_loop()
    load = Load()
    workers = [asyncio.create_task(load.worker(stack.stub, n)) for n in range(WORKERS)]
    await asyncio.sleep(STEADY_S)  # steady load before the switch
    switch_started = loop.time()
    took: Switchover = await asyncio.to_thread(stack.pair.switchover)
    switched = load.switched = loop.time()
    # then until enough activations succeeded on the new primary
    await asyncio.wait_for(load.enough_after.wait(), 120)
    load.stop.set()
    await asyncio.gather(*workers)
    calls, activated = load.calls, load.activated

    # -- every answer: success, or UNAVAILABLE with a retry hint, within the bound
    first_after = first_write_after(calls, switched)
    print(
        f"\nswitchover {took.total_s:.2f} s (stop {took.stop_s:.2f} s, promote "
        f"{took.promote_s:.2f} s); {write_gaps(calls, switch_started, switched)}"
    )
    during = check_answers(calls, switch_started, first_after)
    print(f"{len(during)} calls answered during the switch")
    assert first_after - switched < 30  # calls succeed again without a restart

    # -- no committed activation was lost: each has its record on the new primary
    conn = await asyncpg.connect(stack.database_url)
    try:
        assert await conn.fetchval("SHOW port") == str(stack.pair.second.port)
        recorded = {r["id"] for r in await conn.fetch("SELECT id FROM sandboxes")}
    finally:
        await conn.close()
    assert activated <= recorded, activated - recorded

    # -- nothing stranded: live + pending equals the pods, then nothing at all
    pods = live_pods(stack.kube)
    assert all(len(names) == 1 for names in pods.values()), pods  # one runtime per sandbox
    after_load, settle_s = await settled(stack.admission.address, redis, redis_prefix, stack.kube)
    print(
        f"settled {settle_s:.1f} s after the load: {len(after_load.live)} live, "
        f"drift {after_load.drift(live_pods(stack.kube))}"
    )
    assert after_load.immortal_holds == 0
    await deactivate_all(stack.stub, activated)
    final, _ = await settled(stack.admission.address, redis, redis_prefix, stack.kube)
    assert live_pods(stack.kube) == {}
    assert (final.live, final.node_slots) == (frozenset(), {})
