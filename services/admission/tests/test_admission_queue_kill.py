"""A replica SIGKILLed with waiters in the fair queue leaves nothing behind (SPEC Q1,
X6): its waiters are dropped (never granted) once its lease is over, and the other
replicas' waiters are served. (A grant a dead replica never claimed going back to
the bucket: test_admission_queue_lua.py, on a frozen clock.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc.aio
import redis.asyncio as aioredis

from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_testing.eventually import eventually
from turnstile_testing.service_process import ServiceProcess

if TYPE_CHECKING:
    from conftest import QueueProbe

ADMITTED = admission_pb2.DECISION_ADMITTED
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
    return not [k for k in keys if not k.endswith((b"q:meta", b"q:vf", b"q:owners"))]


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
