"""The relay at scale (SPEC F6): its own stream limit, the idle timeout, the maximum
connection age, and workers that spread their reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from itertools import islice
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_affinity.relay import stream_max_age_s
from turnstile_affinity.settings import AffinitySettings
from turnstile_affinity.worker.agent import WorkerAgent
from turnstile_affinity.worker.backoff import reconnect_delays
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_contracts import affinity_pb2
from turnstile_platform.errors import decode
from turnstile_platform.tiers import TIER_LABEL

if TYPE_CHECKING:
    from conftest import Affinity, Credentials, StartAffinity, StartWorker

Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]
_SERVICE = affinity_pb2.DESCRIPTOR.services_by_name["AffinityService"].full_name


async def _attach(service: Affinity, credentials: Credentials, sandbox_id: str) -> Call:
    credential = (await credentials.issue(sandbox_id)).credential
    hello = affinity_pb2.Hello(
        sandbox_id=sandbox_id, capacity=4, labels={TIER_LABEL: "a"}, credential=credential
    )
    call: Call = service.stub.Attach(None)
    await call.write(affinity_pb2.AttachRequest(hello=hello))
    return call


async def _welcomed(call: Call) -> None:
    message = await call.read()
    assert isinstance(message, affinity_pb2.AttachResponse), message
    assert message.HasField("welcome")


async def test_attach_streams_past_the_unary_limit_leave_place_free_and_the_stream_limit_refuses(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(max_concurrent_rpcs=2, max_concurrent_streams=4)
    streams = [await _attach(service, credentials, f"s{i}") for i in range(4)]
    for stream in streams:
        await _welcomed(stream)
    # Four worker streams, twice the unary limit: Place still answers.
    placed = await asyncio.gather(*(service.place(f"chat-{i}") for i in range(2)))
    assert {p.sandbox_id for p in placed} <= {f"s{i}" for i in range(4)}
    refused = await _attach(service, credentials, "s4")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await refused.read()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    rich = decode(raised.value)
    assert rich.reason == "CONCURRENCY_LIMITED"
    assert {k: rich.metadata[k] for k in ("kind", "limit", "method")} == {
        "kind": "stream",
        "limit": "4",
        "method": "Attach",
    }
    assert rich.retry_after_s is not None
    # The refused Hello changed nothing.
    assert "s4" not in await service.workers()
    for stream in streams:
        stream.cancel()


async def test_a_burst_of_hellos_past_the_relays_redis_bound_queues_and_all_attach(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(relay_max_redis_calls=2)
    streams = await asyncio.gather(*(_attach(service, credentials, f"b{i}") for i in range(40)))
    await asyncio.wait_for(asyncio.gather(*(_welcomed(s) for s in streams)), 60)
    assert set(await service.workers()) == {f"b{i}" for i in range(40)}
    for stream in streams:
        stream.cancel()


async def test_a_silent_stream_is_detached_after_the_idle_timeout(
    affinity: StartAffinity, credentials: Credentials, redis: aioredis.Redis
) -> None:
    service = await affinity(heartbeat_interval_s=0.2, presence_ttl_s=1.0)
    call = await _attach(service, credentials, "quiet")
    await _welcomed(call)
    assert "quiet" in await service.workers()
    # The worker sends nothing more; the relay ends the stream after the presence ttl.
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        async with asyncio.timeout(60):
            await call.read()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no heartbeat" in (raised.value.details() or "")
    # The teardown ran: presence removed, then the detach mark written (SPEC T5).
    assert "quiet" not in await service.workers()
    assert await redis.exists(service.keys.detached("quiet"))


async def test_a_stream_that_keeps_heartbeating_outlives_the_idle_timeout(
    affinity: StartAffinity, credentials: Credentials, redis: aioredis.Redis
) -> None:
    service = await affinity(heartbeat_interval_s=0.1, presence_ttl_s=2.0)
    call = await _attach(service, credentials, "busy")
    await _welcomed(call)
    # Heartbeats paced at the interval for twice the idle timeout: the stream stays.
    for _ in range(40):
        await asyncio.sleep(0.1)  # the worker's pace, not a wait for something
        await call.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
        ack = await call.read()
        assert isinstance(ack, affinity_pb2.AttachResponse), ack
        assert ack.HasField("heartbeat_ack")
    assert not await redis.exists(service.keys.detached("busy"))
    await call.write(affinity_pb2.AttachRequest(goodbye=affinity_pb2.Goodbye()))
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_max_connection_age_makes_a_worker_reattach_keeping_presence_and_sessions(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    service = await affinity(max_connection_age_s=0.5, max_connection_age_grace_s=0)
    streams_before = _streams()
    w1 = await worker(service.address, "aging")
    first = await service.place("chat")
    assert first.sandbox_id == "aging"
    await service.release(first)
    # The stream ends at its maximum age; the worker attaches again, twice.
    await w1.welcomed(3)
    # Ending a stream at its age is not the sandbox leaving: no detach mark,
    # presence kept, and the session's sandbox is still its own.
    assert not await redis.exists(service.keys.detached("aging"))
    assert "aging" in await service.workers()
    again = await service.place("chat")
    assert again.sandbox_id == "aging"
    assert again.outcome == affinity_pb2.PLACEMENT_OUTCOME_HIT
    # Streams that ended at their age left the replica's stream count: one is live.
    await w1.agent.attached.wait()
    assert _streams() == streams_before + 1


def _streams() -> float:
    """This process's ``turnstile_affinity_relay_streams`` (every replica in it)."""
    return REGISTRY.get_sample_value("turnstile_affinity_relay_streams") or 0.0


def test_a_stream_lives_past_its_connections_goaway_and_before_the_grace_ends() -> None:
    rng = random.Random(7)
    ages = [stream_max_age_s(1800, rng) for _ in range(1000)]
    assert all(age is not None and 1.15 * 1800 <= age < 1.35 * 1800 for age in ages)
    # gRPC sends GOAWAY at the connection's age +10% at most: every stream ends later.
    assert min(a for a in ages if a is not None) > 1.1 * 1800
    assert stream_max_age_s(0, rng) is None
    # The defaults leave streams time to end on their own before gRPC cuts them.
    settings = AffinitySettings(worker_attestation="off")
    assert settings.max_connection_age_grace_s >= 1.35 * settings.max_connection_age_s


def test_a_grace_shorter_than_a_streams_life_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="MAX_CONNECTION_AGE_GRACE_S"):
        AffinitySettings(
            worker_attestation="off", max_connection_age_s=600, max_connection_age_grace_s=60
        )


def test_reconnect_delays_are_full_jitter_in_doubling_windows_up_to_the_cap() -> None:
    delays = reconnect_delays(1.0, 10.0, random.Random(42))
    windows = [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    drawn = [next(delays) for _ in windows]
    for delay, window in zip(drawn, windows, strict=True):
        assert 0.0 <= delay <= window
    # The same seed gives the same schedule; another seed another one.
    assert drawn == list(islice(reconnect_delays(1.0, 10.0, random.Random(42)), 7))
    assert drawn != list(islice(reconnect_delays(1.0, 10.0, random.Random(43)), 7))


def test_a_replicas_workers_spread_their_first_reconnects_over_the_window() -> None:
    # 10,000 workers lose their streams at once: their first waits cover the
    # whole window evenly instead of arriving together.
    firsts = [next(reconnect_delays(1.0, 10.0, random.Random(seed))) for seed in range(10_000)]
    buckets = [0] * 10
    for delay in firsts:
        buckets[min(int(delay * 10), 9)] += 1
    assert all(800 <= count <= 1200 for count in buckets), buckets
    assert max(firsts) - min(firsts) > 0.95


@contextlib.asynccontextmanager
async def _silent_relay() -> AsyncIterator[tuple[str, asyncio.Queue[affinity_pb2.AttachRequest]]]:
    """A relay that reads every Hello and never welcomes it (a stream opened just as
    its connection went away looks the same to the worker): its address and the
    requests it read."""
    requests_read: asyncio.Queue[affinity_pb2.AttachRequest] = asyncio.Queue()

    async def silent_attach(
        requests: AsyncIterator[affinity_pb2.AttachRequest],
        _: grpc.aio.ServicerContext[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse],
    ) -> None:
        async for request in requests:  # reads, and writes nothing
            requests_read.put_nowait(request)

    handler = grpc.stream_stream_rpc_method_handler(
        silent_attach,
        request_deserializer=affinity_pb2.AttachRequest.FromString,
        response_serializer=affinity_pb2.AttachResponse.SerializeToString,
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(_SERVICE, {"Attach": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", requests_read
    finally:
        await server.stop(None)


def _agent(address: str, welcome_timeout_s: float) -> WorkerAgent:
    return WorkerAgent(
        WorkerSettings(
            sandbox_id="unwelcome",
            affinity_addr=address,
            plaintext=True,
            welcome_timeout_s=welcome_timeout_s,
            reconnect_initial_s=0.05,
            reconnect_max_s=0.1,
        )
    )


async def test_a_hello_left_unanswered_is_given_up_and_sent_again() -> None:
    async with _silent_relay() as (address, requests_read):
        agent = _agent(address, welcome_timeout_s=0.2)
        task = asyncio.create_task(agent.run())
        try:
            async with asyncio.timeout(10):
                first, second = await requests_read.get(), await requests_read.get()
            assert first.HasField("hello")
            assert second.HasField("hello")
            assert agent.welcomes == 0
            assert not task.done()
        finally:
            agent.stop.set()
            await asyncio.wait_for(task, 10)


async def test_a_worker_stopped_while_awaiting_its_welcome_returns_at_once() -> None:
    async with _silent_relay() as (address, requests_read):
        agent = _agent(address, welcome_timeout_s=120)
        task = asyncio.create_task(agent.run())
        async with asyncio.timeout(10):
            assert (await requests_read.get()).HasField("hello")
        agent.stop.set()
        # Well inside the welcome timeout: the stop is not left waiting behind it.
        await asyncio.wait_for(task, 10)
