"""A replica SIGKILLed with waiters in the fair queue leaves nothing behind (SPEC Q1,
X6): its waiters are dropped (never granted) once its lease is over, and the other
replicas' waiters are served. (A grant a dead replica never claimed going back to
the bucket: test_admission_queue_lua.py, on a frozen clock.) And Redis restarted
mid-queue, with or without its data, leaves no drift (``-m faults``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_testing.eventually import eventually
from turnstile_testing.processes import RedisProcess
from turnstile_testing.service_process import ServiceProcess

if TYPE_CHECKING:
    from conftest import QueueProbe

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED
QUEUE = {"tick_interval_s": 0.01, "owner_ttl_s": 0.5, "claim_ttl_s": 0.5}


def warm(sandbox_id: str, client_id: str, wait_s: float) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    )
    request.wait_budget.FromMilliseconds(round(wait_s * 1000))
    return request


@dataclass
class Victim:
    """An admission process that is SIGKILLed with waiters in the queue."""

    redis: aioredis.Redis
    redis_url: str
    prefix: str
    clients: tuple[str, ...]
    tmp_path: Path

    async def kill_with_waiters(
        self, env: dict[str, str], request: Callable[[str, str, float], admission_pb2.AdmitRequest]
    ) -> admission_pb2.AdmitResponse:
        """Start it, admit ``sb-0`` for ``acme`` (taking what the waiters then wait
        for), queue four calls of client ``dead``, and SIGKILL it; the first answer."""
        env = {
            "TURNSTILE_REDIS_URL": self.redis_url,
            "TURNSTILE_REDIS_PREFIX": self.prefix,
            "TURNSTILE_CLIENT_ALLOWLIST": json.dumps(self.clients),
            "TURNSTILE_QUEUE": json.dumps(QUEUE),
            **env,
        }
        victim = ServiceProcess("turnstile_admission", env, self.tmp_path / "victim.log")
        await victim.start()
        channel = grpc.aio.insecure_channel(victim.address)
        stub: Any = admission_pb2_grpc.AdmissionServiceStub(channel)
        try:
            first: admission_pb2.AdmitResponse = await stub.Admit(request("sb-0", "acme", 0))
            assert first.decision == ADMITTED
            calls = [stub.Admit(request(f"dead-{n}", "dead", 30), timeout=40) for n in range(4)]
            await eventually(lambda: _waiting(self.redis, self.prefix, 4), what="the waiters")
            victim.kill()
            for call in calls:
                call.cancel()
        finally:
            await channel.close(None)
            victim.kill()
        return first


async def queue_is_empty(redis: aioredis.Redis, prefix: str) -> bool:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:q:*")]
    return not [k for k in keys if not k.endswith((b"q:meta", b"q:vf", b"q:owners", b"q:pace"))]


async def test_a_killed_replicas_waiters_are_dropped_and_the_others_served(
    start_admission: Any, redis: aioredis.Redis, redis_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    clients = ("dead", "alive", "acme")
    env = {
        "TURNSTILE_RATE__CLUSTER_RATE_PER_S": "0.001",  # nothing refills while they queue
        "TURNSTILE_RATE__CLUSTER_BURST": "1",
    }
    victim = Victim(redis, redis_url, redis_prefix, clients, tmp_path)
    await victim.kill_with_waiters(env, warm)

    survivor = await start_admission(
        client_allowlist=clients,
        rate={"cluster_rate_per_s": 20, "cluster_burst": 1},
        queue=QUEUE,
    )
    answers = await asyncio.gather(
        *(survivor.stub.Admit(warm(f"alive-{n}", "alive", 10), timeout=15) for n in range(3))
    )
    assert all(a.decision == ADMITTED for a in answers), [a.message for a in answers]
    # The victim's waiters were never granted: dropped, then the queue emptied.
    assert await eventually(lambda: queue_is_empty(redis, redis_prefix), timeout_s=10)
    holds = [k async for k in redis.scan_iter(match=f"{redis_prefix}{{adm}}:hold:*")]
    assert len(holds) == 1 + 3  # sb-0 and the survivor's three: none of the victim's


async def _waiting(redis: aioredis.Redis, prefix: str, count: int) -> bool:
    return int(await redis.hlen(f"{prefix}{{adm}}:q:info")) >= count


RATE = 4.0  # cluster tokens a second, burst 1
BUDGET_S = 6.0
WAITERS = 12
PREFIX = "restart:"


@pytest.fixture(params=[True, False], ids=["kept", "lost"])
async def restartable(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RedisProcess, bool]]:
    """A private Redis (``./scripts/test -m faults``). ``kept``: its data survives
    a restart (append-only file synced on every write); ``lost``: nothing persists."""
    kept: bool = request.param
    options = ("--appendonly", "yes", "--appendfsync", "always") if kept else ()
    server = RedisProcess(options=options).start()
    try:
        yield server, kept
    finally:
        server.close()


@pytest.mark.faults
@pytest.mark.timeout(120)
async def test_a_redis_restart_mid_queue_leaves_no_drift(
    start_admission: Any, restartable: tuple[RedisProcess, bool]
) -> None:
    """Restarted with its data (append-only file on) or without (nothing persisted,
    as P6 allows), there is no drift: every waiter is answered within its budget,
    grants never exceed what the cluster bucket could give, no hold is taken
    twice, and nothing is left in the queue (SPEC Q1, X6)."""
    server, kept = restartable
    running = await start_admission(
        redis_url=server.url,
        redis_prefix=PREFIX,
        client_allowlist=("acme", "l1"),
        rpc_timeout_s=60,
        rate={
            "cluster_rate_per_s": RATE,
            "cluster_burst": 1,
            "default_rate_per_s": 1000,
            "default_burst": 1000,
        },
        concurrency={"default_limit": 10_000},
        cap={"mode": "off"},
        queue={"tick_interval_s": 0.01},
    )
    client = aioredis.Redis.from_url(server.url)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        assert (await running.stub.Admit(warm("sb-0", "acme", 0))).decision == ADMITTED

        async def timed(call: Awaitable[Any]) -> tuple[Any, float]:
            began = loop.time()
            answer = await call
            return answer, loop.time() - began

        calls = [
            asyncio.ensure_future(
                timed(running.stub.Admit(warm(f"sb-{n}", ("acme", "l1")[n % 2], BUDGET_S)))
            )
            for n in range(WAITERS)
        ]
        await eventually(lambda: _waiting(client, PREFIX, 8), what="waiters in the queue")
        await client.aclose()
        server.stop()
        restarted = loop.time()
        server.start()
        client = aioredis.Redis.from_url(server.url)
        answered = await asyncio.gather(*calls)
        ended = loop.time()

        answers = [a for a, _ in answered]
        assert {a.decision for a in answers} <= {ADMITTED, REFUSED}, [a.message for a in answers]
        # Each within its budget (and the claim's margin), never hanging on.
        assert max(took for _, took in answered) <= BUDGET_S + 1.0
        admitted = [a for a in answers if a.decision == ADMITTED]
        assert len({a.hold_id for a in admitted}) == len(admitted)  # none granted twice
        # Never past the bucket: its burst and refill, plus one more burst when the
        # restart lost the bucket (a fresh one starts full), and a little clock slack.
        could = 1 + RATE * (ended - started + 0.1) + (0 if kept else 1)
        assert 1 + len(admitted) <= could, (len(admitted), could)
        # Kept, the queue came back with its data; lost, each waiter joined again
        # (turnstile_admission_queue_rejoined_total): either way all were served.
        assert len(admitted) == WAITERS, [a.message for a in answers]
        # Nothing left behind: no queue entry, and a hold for each admitted call only.
        assert await eventually(lambda: queue_is_empty(client, PREFIX), timeout_s=10)
        holds = [k async for k in client.scan_iter(match=f"{PREFIX}{{adm}}:hold:*")]
        assert len(holds) == len(admitted) + (1 if kept else 0)  # sb-0's if it survived
        print(
            f"\n{'kept' if kept else 'lost'}: {len(admitted)}/{WAITERS} admitted, "
            f"restart at {restarted - started:.2f}s, all answered by {ended - started:.2f}s"
        )
    finally:
        await client.aclose()


def cold(sandbox_id: str, client_id: str, wait_s: float) -> admission_pb2.AdmitRequest:
    request = warm(sandbox_id, client_id, wait_s)
    request.kind = common_pb2.ACTIVATION_KIND_COLD_CREATE
    request.candidate_nodes.append("n1")
    return request


async def test_a_killed_replicas_slot_waiters_are_dropped_and_the_slot_served(
    start_admission: Any,
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    queue: QueueProbe,
) -> None:
    """Node-slot waiters (SPEC Q1): the victim's four wait for n1's one slot; after
    the kill, the slot that frees ends with the survivor's waiter, and when it
    frees again the victim's, at the head, are dropped, never granted: no entry
    and no reserved slot is left."""
    clients = ("dead", "alive", "acme")
    slots = {"per_node": {"n1": 1}}
    victim = Victim(redis, redis_url, redis_prefix, clients, tmp_path)
    first = await victim.kill_with_waiters({"TURNSTILE_SLOTS": json.dumps(slots)}, cold)

    survivor = await start_admission(client_allowlist=clients, slots=slots, queue=QUEUE)
    waiting = asyncio.ensure_future(survivor.stub.Admit(cold("alive-0", "alive", 10), timeout=15))
    await eventually(lambda: _waiting(redis, redis_prefix, 5), what="the survivor's waiter")
    await survivor.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=first.hold_id))
    answer = await waiting
    assert answer.decision == ADMITTED, answer.message
    assert answer.node == "n1"
    # The slot frees again: the victim's waiters, now at the head, are dropped
    # (their replica's lease is over), never granted: nothing is reserved, and
    # nothing of them is left.
    owners = f"{redis_prefix}{{adm}}:q:owners"
    await eventually(lambda: _one_owner(redis, owners), what="the victim's lease over")
    await survivor.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=answer.hold_id))
    assert await eventually(queue.empty, timeout_s=10)
    assert await redis.zrange(survivor.keys.slots("n1"), 0, -1) == []


async def _one_owner(redis: aioredis.Redis, owners: str) -> bool:
    """Only one replica's lease is left (the survivor's ticks drop expired ones)."""
    return int(await redis.zcard(owners)) == 1
