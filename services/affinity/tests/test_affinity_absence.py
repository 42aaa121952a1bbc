"""Absent sandboxes: pending for the grace, wakes, fallback with a reset (SPEC T4, T7, T9).

Time inside the store's scripts is Redis TIME plus a clock offset the tests
move forward, so a grace period is crossed without sleeping through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_affinity.store import Clock
from turnstile_contracts import affinity_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_testing.authz import redis_snapshot
from turnstile_testing.plugin import CredentialKeyFiles
from turnstile_testing.processes import free_port

if TYPE_CHECKING:
    from conftest import Affinity, StartAffinity, StartWorker, Worker

HIT = affinity_pb2.PLACEMENT_OUTCOME_HIT
FALLBACK = affinity_pb2.PLACEMENT_OUTCOME_FALLBACK
GRACE_S = 30.0
#: How long an exactly-once check waits for a second event that must not come.
NO_MORE_WINDOW_S = 1.0
#: The client the fixtures' sandboxes and sessions belong to (conftest's TENANT).
TENANT = "acme"


async def tier_a(
    affinity: StartAffinity, worker: StartWorker, clock: Clock | None = None, **settings: Any
) -> tuple[Affinity, dict[str, Worker]]:
    """Tiers a and b; a1, a2 in a and b1 in b, capacity 16 each.

    Presence outlives the clock jumps across the grace (it lasts 120 s).
    """
    settings = {"presence_ttl_s": 120.0, **settings}
    service = await affinity(clock, tiers="a,b", grace_s=GRACE_S, **settings)
    workers = {
        sandbox_id: await worker(service.address, sandbox_id, sandbox_id[0], capacity=16)
        for sandbox_id in ("a1", "a2", "b1")
    }
    return service, workers


async def session_on_a1(service: Affinity, session_id: str = "chat") -> None:
    placed = await service.place(session_id, "a")
    assert placed.sandbox_id == "a1"
    await service.release(placed)


async def test_an_absent_sandbox_is_pending_for_the_grace_then_the_session_falls_back_in_tier(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    clock = Clock()
    service, workers = await tier_a(affinity, worker, clock)
    await session_on_a1(service)
    await workers["a1"].stop()  # Goodbye: presence removed, then the detach mark written

    pending = await service.refused("chat", "a")
    assert pending.code == grpc.StatusCode.UNAVAILABLE
    assert pending.reason == "SANDBOX_PENDING"
    assert pending.metadata["sandbox_id"] == "a1"
    assert GRACE_S * 1000 - 2000 < int(pending.metadata["remaining_grace_ms"]) <= GRACE_S * 1000
    assert pending.retry_after_s == 10

    clock.offset_ms += int(GRACE_S * 1000) - 2500
    later = await service.refused("chat", "a")
    assert later.reason == "SANDBOX_PENDING"
    assert later.retry_after_s == 3  # ceil(≈2.5 s) (SPEC T9)
    assert (await service.workers("a"))["a2"].leases == 0  # waiting took nothing

    clock.offset_ms += 2600
    moved = await service.place("chat", "a")
    assert (moved.sandbox_id, moved.outcome, moved.tier) == ("a2", FALLBACK, "a")
    assert moved.reset.reason == affinity_pb2.RESET_REASON_GRACE_EXPIRED
    assert (moved.reset.from_sandbox_id, moved.reset.to_sandbox_id) == ("a1", "a2")
    session = await service.stub.GetSession(
        affinity_pb2.GetSessionRequest(client_id="acme", session_id="chat")
    )
    assert session.sandbox_id == "a2"
    assert session.last_reset == moved.reset
    await service.release(moved)

    again = await service.place("chat", "a")
    assert (again.sandbox_id, again.outcome) == ("a2", HIT)
    assert not again.HasField("reset")


async def test_pending_retry_hint_is_at_least_one_second(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    clock = Clock()
    service, workers = await tier_a(affinity, worker, clock, retry_after_s=4)
    await session_on_a1(service)
    await workers["a1"].stop()
    clock.offset_ms += int(GRACE_S * 1000) - 200
    pending = await service.refused("chat", "a")
    assert 0 < int(pending.metadata["remaining_grace_ms"]) <= 200
    assert pending.retry_after_s == 1


async def test_detach_marks_expire_after_the_affinity_ttl(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    service, workers = await tier_a(affinity, worker, affinity_ttl_s=120)
    await session_on_a1(service)
    assert not await redis.exists(service.keys.detached("a1"))
    await workers["a1"].stop()
    assert 118_000 < await redis.pttl(service.keys.detached("a1")) <= 120_000
    # A first-sight mark (no detach was seen) expires the same way.
    await redis.delete(service.keys.detached("a1"))
    await service.refused("chat", "a")
    assert 118_000 < await redis.pttl(service.keys.detached("a1")) <= 120_000
    # The session record lives as long after its last turn.
    assert 118_000 < await redis.pttl(service.keys.session("chat", "acme")) <= 120_000


async def test_a_returning_worker_clears_its_mark_and_keeps_its_sessions(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    clock = Clock()
    service, workers = await tier_a(affinity, worker, clock)
    await session_on_a1(service)
    await workers["a1"].stop()
    await service.refused("chat", "a")
    clock.offset_ms += int(GRACE_S * 1000) - 1000
    returned = await worker(service.address, "a1", "a", capacity=16)
    assert not await redis.exists(service.keys.detached("a1"))
    back = await service.place("chat", "a")
    assert (back.sandbox_id, back.outcome) == ("a1", HIT)
    await service.release(back)
    # A later absence counts its grace afresh.
    await returned.stop()
    pending = await service.refused("chat", "a")
    assert int(pending.metadata["remaining_grace_ms"]) > GRACE_S * 1000 - 2000


@pytest.mark.redis_topologies("cluster")
async def test_two_concurrent_fallbacks_past_the_grace_move_the_session_once(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    clock = Clock()
    one, workers = await tier_a(affinity, worker, clock)
    two = await affinity(clock, tiers="a,b", grace_s=GRACE_S, presence_ttl_s=120.0)
    await worker(one.address, "a3", "a", capacity=16)
    await session_on_a1(one)
    await workers["a1"].stop()
    clock.offset_ms += int(GRACE_S * 1000) + 1000
    placed = await asyncio.gather(*((one if i % 2 else two).place("chat", "a") for i in range(10)))
    assert len({p.sandbox_id for p in placed}) == 1, placed
    assert Counter(p.outcome for p in placed) == {FALLBACK: 1, HIT: 9}
    resets = [p.reset for p in placed if p.HasField("reset")]
    assert len(resets) == 1
    assert resets[0].from_sandbox_id == "a1"
    session = await one.stub.GetSession(
        affinity_pb2.GetSessionRequest(client_id="acme", session_id="chat")
    )
    assert session.last_reset == resets[0]


# A relay restart that loses presence ------------------------------------------------


async def _start_affinity_process(
    redis_url: str, redis_prefix: str, port: int, public_keys_file: Path, presence_ttl_s: float
) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        "TURNSTILE_PORT": str(port),
        "TURNSTILE_METRICS_PORT": "0",
        "TURNSTILE_REDIS_URL": redis_url,
        "TURNSTILE_REDIS_PREFIX": redis_prefix,
        "TURNSTILE_TIERS": "a,b",
        "TURNSTILE_GRACE_S": str(GRACE_S),
        "TURNSTILE_WAKE_ENABLED": "false",
        "TURNSTILE_HEARTBEAT_INTERVAL_S": "0.2",
        "TURNSTILE_PRESENCE_TTL_S": str(presence_ttl_s),
        "TURNSTILE_LOG_FORMAT": "text",
        "OTEL_TRACES_EXPORTER": "none",
        "TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE": str(public_keys_file),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnstile_affinity",
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    async with asyncio.timeout(15):
        while b" serving" not in (line := await proc.stderr.readline()):
            assert line, "the affinity process exited before serving"
    return proc


@pytest.fixture
async def crashable(
    redis_url: str, redis_prefix: str, credential_keys: CredentialKeyFiles
) -> AsyncIterator[Any]:
    procs: list[asyncio.subprocess.Process] = []

    async def start(port: int, presence_ttl_s: float = 5) -> asyncio.subprocess.Process:
        proc = await _start_affinity_process(
            redis_url, redis_prefix, port, credential_keys.public_keys_file, presence_ttl_s
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_after_a_relay_crash_sessions_wait_from_first_sight_and_return_to_their_sandbox(
    affinity: StartAffinity, worker: StartWorker, crashable: Any, redis: aioredis.Redis
) -> None:
    port = free_port()
    relay = await crashable(port)
    clock = Clock()
    placer = await affinity(clock, tiers="a,b", grace_s=GRACE_S, presence_ttl_s=5)
    a1 = await worker(f"127.0.0.1:{port}", "a1", "a", capacity=16)
    await worker(f"127.0.0.1:{port}", "a2", "a", capacity=16)
    await session_on_a1(placer)

    relay.kill()  # no teardown runs: presence stays until it expires, no detach mark
    await relay.wait()
    await a1.detached()  # so that attached() below means the new relay's Welcome
    clock.offset_ms += 5_100  # past the presence ttl
    assert await placer.workers("a") == {}
    assert not await redis.exists(placer.keys.detached("a1"))

    first = await placer.refused("chat", "a")
    assert first.reason == "SANDBOX_PENDING"
    assert GRACE_S * 1000 - 1000 < int(first.metadata["remaining_grace_ms"]) <= GRACE_S * 1000
    assert await redis.exists(placer.keys.detached("a1"))  # first sight, shared by replicas
    clock.offset_ms += 4_000
    second = await placer.refused("chat", "a")
    assert (
        int(second.metadata["remaining_grace_ms"])
        <= int(first.metadata["remaining_grace_ms"]) - 4000
    )

    # The relay comes back on the same address; the workers reconnect by themselves.
    await affinity(clock, tiers="a,b", grace_s=GRACE_S, port=port, presence_ttl_s=5)
    await a1.attached()
    back = await placer.place("chat", "a")
    assert (back.sandbox_id, back.outcome) == ("a1", HIT)


async def test_after_a_relay_crash_a_worker_takes_its_still_live_presence_back_at_once(
    affinity: StartAffinity, worker: StartWorker, crashable: Any, redis: aioredis.Redis
) -> None:
    # The crashed relay's stream still owns a presence that has not expired: only
    # the worker's credential lets its first Hello to the new relay take it over
    # (SPEC Z3), without waiting for the presence ttl and without any refusal.
    port = free_port()
    relay = await crashable(port, presence_ttl_s=300)
    placer = await affinity(tiers="a,b", presence_ttl_s=300)
    a1 = await worker(f"127.0.0.1:{port}", "a1", "a", capacity=16)
    await session_on_a1(placer)
    dead_owner = await redis.hget(placer.keys.presence("a1"), "owner")
    refusals = _refusals()

    relay.kill()
    await relay.wait()
    assert await redis.hget(placer.keys.presence("a1"), "owner") == dead_owner  # still live
    await a1.detached()  # so that attached() below means the new relay's Welcome

    await affinity(tiers="a,b", port=port, presence_ttl_s=300)
    await a1.attached()
    assert await redis.hget(placer.keys.presence("a1"), "owner") != dead_owner
    assert _refusals() == refusals  # the first Hello after the restart was welcomed
    back = await placer.place("chat", "a")
    assert (back.sandbox_id, back.outcome) == ("a1", HIT)


def _refusals() -> float:
    """Credential refusals so far, every reason (in-process replicas share the registry)."""
    total = 0.0
    for metric in REGISTRY.collect():
        if metric.name == "turnstile_affinity_credential_refusals":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


# Wakes ------------------------------------------------------------------------------


class CountingSubstrate(substrate_pb2_grpc.SubstrateServiceServicer):
    """A real SubstrateService server that records Activate calls and answers
    GetSandbox with each sandbox's recorded owner (``owners``, else the fixtures'
    tenant), as the wake reads it first (SPEC O2)."""

    def __init__(self) -> None:
        self.calls: list[substrate_pb2.ActivateRequest] = []
        self.metadata: list[dict[str, str | bytes]] = []
        self.owners: dict[str, str] = {}
        self.reads: list[str] = []
        self.changed = asyncio.Condition()

    async def GetSandbox(
        self,
        request: substrate_pb2.GetSandboxRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> substrate_pb2.GetSandboxResponse:
        async with self.changed:
            self.reads.append(request.sandbox_id)
            self.changed.notify_all()
        owner = self.owners.get(request.sandbox_id, TENANT)
        return substrate_pb2.GetSandboxResponse(
            sandbox=substrate_pb2.Sandbox(sandbox_id=request.sandbox_id, activating_client_id=owner)
        )

    async def wait_for_reads(self, count: int) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.reads) >= count), 10)

    async def Activate(
        self,
        request: substrate_pb2.ActivateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> substrate_pb2.ActivateResponse:
        async with self.changed:
            self.calls.append(request)
            self.metadata.append(dict(context.invocation_metadata() or ()))
            self.changed.notify_all()
        return substrate_pb2.ActivateResponse(
            sandbox=substrate_pb2.Sandbox(sandbox_id=request.sandbox_id),
            outcome=substrate_pb2.OUTCOME_CREATED,
        )

    async def wait_for_calls(self, count: int) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: len(self.calls) >= count), 10)

    async def no_call_beyond(self, count: int, window_s: float) -> None:
        """Fail as soon as call ``count + 1`` arrives within ``window_s``."""
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: len(self.calls) > count), window_s
                )
            assert len(self.calls) == count, f"{len(self.calls)} calls, expected {count}"


@pytest.fixture
async def substrate() -> AsyncIterator[tuple[CountingSubstrate, str]]:
    servicer = CountingSubstrate()  # type: ignore[abstract]  # only Activate is served
    server = grpc.aio.server()
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(None)


async def test_an_absence_wakes_its_sandbox_exactly_once_through_substrate_with_inherit(
    affinity: StartAffinity,
    worker: StartWorker,
    substrate: tuple[CountingSubstrate, str],
) -> None:
    counting, address = substrate
    settings: dict[str, Any] = {"wake_enabled": True, "substrate_addr": address}
    one, workers = await tier_a(affinity, worker, **settings)
    two = await affinity(tiers="a,b", grace_s=GRACE_S, **settings)
    await session_on_a1(one)
    await workers["a1"].stop()

    turns = [(one if i % 2 else two).refused("chat", "a") for i in range(20)]
    refusals = await asyncio.gather(*turns)
    assert {r.reason for r in refusals} == {"SANDBOX_PENDING"}
    await counting.wait_for_calls(1)
    await counting.no_call_beyond(1, NO_MORE_WINDOW_S)  # a second wake would be late, not absent
    assert len(counting.calls) == 1
    call = counting.calls[0]
    assert call.sandbox_id == "a1"
    assert call.client.WhichOneof("client") == "inherit"
    assert call.tier == "a"
    assert "traceparent" in counting.metadata[0]  # the wake continues the Place's trace
    # A turn with no deadline lets the wake wait for its own, less the margin.
    assert 25.0 < call.wait_budget.ToMilliseconds() / 1000 <= 30.0 - 1.0

    # The worker comes back, then leaves again: a new absence, a new wake.
    back = await worker(one.address, "a1", "a", capacity=16)
    assert (await one.place("chat", "a")).outcome == HIT
    await back.stop()
    await asyncio.gather(*(two.refused("chat", "a") for _ in range(5)))
    await counting.wait_for_calls(2)
    assert [c.sandbox_id for c in counting.calls] == ["a1", "a1"]


async def test_a_wake_never_starts_a_sandbox_since_recorded_to_another_client(
    affinity: StartAffinity,
    worker: StartWorker,
    substrate: tuple[CountingSubstrate, str],
) -> None:
    """A session's record names a sandbox id; an operator then re-created that id for
    another client. The wake of this tenant's pending turn must not start it (an
    ``inherit`` Activate would, charged to the other client): placement would refuse
    the turn there anyway (SPEC O2)."""
    counting, address = substrate
    one, workers = await tier_a(affinity, worker, wake_enabled=True, substrate_addr=address)
    await session_on_a1(one)
    await workers["a1"].stop()
    counting.owners["a1"] = "globex"
    not_owned = _wakes("not_owned")

    refusal = await one.refused("chat", "a")
    assert refusal.reason == "SANDBOX_PENDING"
    await counting.wait_for_reads(1)
    await counting.no_call_beyond(0, NO_MORE_WINDOW_S)
    assert counting.reads == ["a1"]
    assert _wakes("not_owned") == not_owned + 1

    # The tenant's own sandbox again: the next absence is woken as before.
    counting.owners["a1"] = TENANT
    back = await worker(one.address, "a1", "a", capacity=16)
    assert (await one.place("chat", "a")).outcome == HIT
    await back.stop()
    await one.refused("chat", "a")
    await counting.wait_for_calls(1)
    assert [c.sandbox_id for c in counting.calls] == ["a1"]


def _wakes(result: str) -> float:
    value = REGISTRY.get_sample_value("turnstile_affinity_wakes_total", {"result": result})
    return value or 0.0


# Prepare (SPEC W2) -------------------------------------------------------------------

PREPARED = affinity_pb2.PrepareOutcome


async def test_prepare_wakes_an_absent_sandbox_once_across_replicas_and_the_turn_sends_no_other(
    affinity: StartAffinity,
    worker: StartWorker,
    substrate: tuple[CountingSubstrate, str],
) -> None:
    counting, address = substrate
    settings: dict[str, Any] = {"wake_enabled": True, "substrate_addr": address}
    one, workers = await tier_a(affinity, worker, **settings)
    two = await affinity(tiers="a,b", grace_s=GRACE_S, **settings)
    await session_on_a1(one)

    running = await one.prepare("chat")
    assert (running.outcome, running.sandbox_id) == (
        PREPARED.Value("PREPARE_OUTCOME_RUNNING"),
        "a1",
    )
    assert not running.HasField("remaining_grace")
    await workers["a1"].stop()

    request = affinity_pb2.PrepareRequest(session_id="chat", client_id=TENANT)
    answers = await asyncio.gather(
        *((one if i % 2 else two).stub.Prepare(request, timeout=8) for i in range(10))
    )
    outcomes = Counter(PREPARED.Name(a.outcome) for a in answers)
    assert outcomes == {"PREPARE_OUTCOME_WAKE_STARTED": 1, "PREPARE_OUTCOME_ALREADY_WAKING": 9}
    assert all(a.sandbox_id == "a1" for a in answers)
    assert all(0 < a.remaining_grace.ToMilliseconds() <= GRACE_S * 1000 for a in answers)
    await counting.wait_for_calls(1)
    call = counting.calls[0]
    assert (call.sandbox_id, call.tier, call.client.WhichOneof("client")) == ("a1", "a", "inherit")
    assert "traceparent" in counting.metadata[0]
    # It may wait in admission's queue for what the caller's deadline leaves, less a
    # margin (and less the owner read before it, which a loaded machine makes slow).
    # The server learns the deadline as a timeout on arrival: allow its transit.
    assert 3.0 < call.wait_budget.ToMilliseconds() / 1000 <= 8.0 - 1.0 + 0.1

    # The turn arrives: pending (no lease), and no second wake of the same absence.
    assert (await two.refused("chat", "a")).reason == "SANDBOX_PENDING"
    await counting.no_call_beyond(1, NO_MORE_WINDOW_S)

    # The sandbox is back (the wake's work): the turn is a hit, and Prepare has nothing to do.
    back = await worker(one.address, "a1", "a", capacity=16)
    assert (await one.prepare("chat")).outcome == PREPARED.Value("PREPARE_OUTCOME_RUNNING")
    assert (await one.place("chat", "a")).outcome == HIT
    await back.stop()


async def test_prepare_of_another_tenants_session_is_no_session_changes_nothing_and_wakes_nothing(
    affinity: StartAffinity,
    worker: StartWorker,
    substrate: tuple[CountingSubstrate, str],
    redis: aioredis.Redis,
) -> None:
    """SPEC O2: the session id is acme's; globex naming it gets what a missing session
    gets, and none of acme's keys (its absence's wake marker above all) is touched."""
    counting, address = substrate
    one, workers = await tier_a(affinity, worker, wake_enabled=True, substrate_addr=address)
    await session_on_a1(one)
    await workers["a1"].stop()
    prefix = one.settings.redis_prefix
    before = await redis_snapshot(redis, prefix)

    other = await one.prepare("chat", client="globex")
    assert other.outcome == PREPARED.Value("PREPARE_OUTCOME_NO_SESSION")
    assert other.sandbox_id == ""
    missing = await one.prepare("no-such-chat")
    assert missing.outcome == PREPARED.Value("PREPARE_OUTCOME_NO_SESSION")
    assert await redis_snapshot(redis, prefix) == before
    await counting.no_call_beyond(0, NO_MORE_WINDOW_S)
    assert counting.reads == []

    # acme's own Prepare still finds its absence unwoken, and wakes it.
    own = await one.prepare("chat")
    assert own.outcome == PREPARED.Value("PREPARE_OUTCOME_WAKE_STARTED")
    await counting.wait_for_calls(1)


async def test_prepare_past_the_grace_or_with_wakes_off_sends_nothing(
    affinity: StartAffinity, worker: StartWorker, substrate: tuple[CountingSubstrate, str]
) -> None:
    counting, address = substrate
    clock = Clock()
    one, workers = await tier_a(affinity, worker, clock, wake_enabled=True, substrate_addr=address)
    off = await affinity(clock, tiers="a,b", grace_s=GRACE_S)  # wake_enabled=False
    await session_on_a1(one)
    await workers["a1"].stop()

    not_woken = await off.prepare("chat")
    assert not_woken.outcome == PREPARED.Value("PREPARE_OUTCOME_NOT_WOKEN")
    assert not_woken.remaining_grace.ToMilliseconds() > 0
    clock.offset_ms += int(GRACE_S * 1000)
    moves = await one.prepare("chat")
    assert (moves.outcome, moves.sandbox_id) == (PREPARED.Value("PREPARE_OUTCOME_WILL_MOVE"), "a1")
    await counting.no_call_beyond(0, NO_MORE_WINDOW_S)


class HangingSubstrate(substrate_pb2_grpc.SubstrateServiceServicer):
    """GetSandbox never answers: a wake stays in flight until it is cancelled."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def GetSandbox(
        self,
        request: substrate_pb2.GetSandboxRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> substrate_pb2.GetSandboxResponse:
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


async def test_the_waker_holds_its_wakes_in_background_tasks_and_cancels_them_at_close() -> None:
    from turnstile_affinity.wake import Waker

    servicer = HangingSubstrate()  # type: ignore[abstract]  # only GetSandbox is served
    server = grpc.aio.server()
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            waker = Waker(substrate_pb2_grpc.SubstrateServiceStub(channel), timeout_s=60)
            waker.wake("a1", "a", TENANT, False)
            await asyncio.wait_for(servicer.started.wait(), 10)
            assert len(waker) == 1  # held until it ends
            await waker.close()
            assert len(waker) == 0
            await asyncio.wait_for(servicer.cancelled.wait(), 10)  # the call went with it
    finally:
        await server.stop(None)
