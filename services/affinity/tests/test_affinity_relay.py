"""The relay and the worker agent (SPEC T1, T5, T6, X6)."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_contracts import affinity_pb2
from turnstile_platform.tiers import TIER_LABEL

if TYPE_CHECKING:
    from conftest import Affinity, Credentials, StartAffinity, StartWorker, StartWorkerProcess


def test_worker_tier_label_unset_uses_the_kind_set_but_empty_sends_none() -> None:
    def labels(**values: object) -> dict[str, str]:
        return WorkerSettings(sandbox_id="s1", **values).labels  # type: ignore[arg-type]

    assert labels() == {TIER_LABEL: "container"}
    assert labels(kind="microvm") == {TIER_LABEL: "microvm"}
    assert labels(tier="gpu") == {TIER_LABEL: "gpu"}
    assert labels(tier="", kind="microvm") == {}
    assert labels(tier="", endpoint="10.0.0.7:8080") == {"endpoint": "10.0.0.7:8080"}


async def test_worker_processes_advertise_their_tier_from_the_environment(
    affinity: StartAffinity, worker_process: StartWorkerProcess
) -> None:
    # What the agent declares, so attestation is off: with it on, the credential's
    # presence claims decide instead (test_affinity_presence.py).
    service = await affinity(worker_attestation="off")
    procs = await asyncio.gather(
        worker_process(service.address, "default-kind"),
        worker_process(service.address, "vm", TURNSTILE_WORKER_KIND="microvm"),
        worker_process(service.address, "empty", TURNSTILE_WORKER_TIER=""),
        worker_process(
            service.address,
            "gpu",
            TURNSTILE_WORKER_TIER="gpu",
            TURNSTILE_WORKER_CAPACITY="3",
            TURNSTILE_WORKER_ENDPOINT="127.0.0.1:9999",
        ),
    )
    await asyncio.gather(*(p.wait_for_log("attached to the relay") for p in procs))
    workers = await service.workers()
    assert workers["default-kind"].tier == "container"
    assert workers["vm"].tier == "microvm"
    assert workers["empty"].tier == ""
    assert TIER_LABEL not in workers["empty"].labels
    assert (workers["gpu"].tier, workers["gpu"].capacity) == ("gpu", 3)
    assert dict(workers["gpu"].labels) == {TIER_LABEL: "gpu", "endpoint": "127.0.0.1:9999"}


async def test_sigterm_says_goodbye_exits_0_and_leaves_a_detach_mark(
    affinity: StartAffinity, worker_process: StartWorkerProcess, redis: aioredis.Redis
) -> None:
    service = await affinity()
    proc = await worker_process(service.address, "w1")
    await proc.wait_for_log("attached to the relay")
    assert "w1" in await service.workers()
    assert await proc.terminate(signal.SIGTERM) == 0
    await proc.wait_for_log("said goodbye to the relay")
    # The relay ended the stream only after its teardown: presence gone, mark written.
    assert "w1" not in await service.workers()
    assert await redis.exists(service.keys.detached("w1"))
    assert not await redis.exists(service.keys.presence("w1"))


async def test_a_killed_worker_is_detached_with_a_mark_and_its_sessions_wait(
    affinity: StartAffinity, worker_process: StartWorkerProcess, redis: aioredis.Redis
) -> None:
    service = await affinity(grace_s=30)
    proc = await worker_process(service.address, "w1")
    await proc.wait_for_log("attached to the relay")
    await service.release(await service.place("chat"))
    assert await proc.terminate(signal.SIGKILL) == -signal.SIGKILL
    # The kernel closes its socket: the relay tears the stream down.
    async with asyncio.timeout(10):
        while "w1" in await service.workers():  # noqa: ASYNC110 - a state in Redis, no event
            await asyncio.sleep(0.02)
    assert await redis.exists(service.keys.detached("w1"))
    assert (await service.refused("chat")).reason == "SANDBOX_PENDING"


async def test_a_worker_reconnects_when_the_relay_goes_away_and_comes_back(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    first = await affinity()
    port = first.app.port
    w1 = await worker(first.address, "w1")
    await first.stop()
    second = await affinity(port=port)
    await w1.attached()
    assert "w1" in await second.workers()


async def test_mislabelled_and_unlabelled_workers_are_excluded_and_logged_once_each(
    affinity: StartAffinity, worker: StartWorker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="turnstile_affinity.relay")
    service = await affinity(tiers="a,b")
    for _ in range(3):  # each reconnects: still one line per sandbox id
        wrong = await worker(service.address, "wrong", "gpu")
        none = await worker(service.address, "none", "")
        await wrong.stop()
        await none.stop()
    await worker(service.address, "wrong", "gpu")
    lines = [r for r in caplog.records if "excluded from placement" in r.getMessage()]
    assert sorted((r.sandbox_id, r.getMessage().split()[0]) for r in lines) == [  # type: ignore[attr-defined]
        ("none", "unlabelled"),
        ("wrong", "mislabelled"),
    ]
    assert (await service.refused("chat", "a")).reason == "TIER_EXHAUSTED"
    assert (await service.refused("chat", "b")).reason == "TIER_EXHAUSTED"


Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]


async def _attach(service: Affinity, hello: affinity_pb2.Hello) -> Call:
    call: Call = service.stub.Attach(None)
    await call.write(affinity_pb2.AttachRequest(hello=hello))
    return call


async def _read(call: Call) -> affinity_pb2.AttachResponse:
    message = await call.read()
    assert isinstance(message, affinity_pb2.AttachResponse), message
    return message


async def test_a_bad_hello_is_invalid_argument_naming_the_field(affinity: StartAffinity) -> None:
    service = await affinity()
    cases = [
        (affinity_pb2.Hello(sandbox_id="", capacity=1), "hello.sandbox_id"),
        (affinity_pb2.Hello(sandbox_id="has/slash", capacity=1), "hello.sandbox_id"),
        (affinity_pb2.Hello(sandbox_id="s1", capacity=0), "hello.capacity"),
        (affinity_pb2.Hello(sandbox_id="s1", capacity=1025), "hello.capacity"),
        (
            affinity_pb2.Hello(sandbox_id="s1", capacity=1, labels={TIER_LABEL: "a/b"}),
            f"hello.labels[{TIER_LABEL}]",
        ),
    ]
    for hello, field in cases:
        call = await _attach(service, hello)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call.read()
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (raised.value.details() or "").startswith(f"{field}:")
    call = service.stub.Attach(None)
    await call.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    assert (raised.value.details() or "").startswith("hello:")
    assert await service.workers() == {}


async def test_a_newer_stream_takes_over_and_the_old_ones_teardown_leaves_it_alone(
    affinity: StartAffinity, redis: aioredis.Redis, credentials: Credentials
) -> None:
    service = await affinity()
    credential = (await credentials.issue("s1")).credential
    hello = affinity_pb2.Hello(
        sandbox_id="s1", capacity=2, labels={TIER_LABEL: "a"}, credential=credential
    )
    attaches = "turnstile_affinity_relay_attaches_total"
    new_before = REGISTRY.get_sample_value(attaches, {"kind": "new"}) or 0.0
    takeovers_before = REGISTRY.get_sample_value(attaches, {"kind": "takeover"}) or 0.0
    old = await _attach(service, hello)
    assert (await _read(old)).HasField("welcome")
    new = await _attach(service, hello)
    assert (await _read(new)).HasField("welcome")
    # Churn is visible: one new attach, then one that took over a live presence.
    assert REGISTRY.get_sample_value(attaches, {"kind": "new"}) == new_before + 1
    assert REGISTRY.get_sample_value(attaches, {"kind": "takeover"}) == takeovers_before + 1
    # The takeover ends the old stream at once (SPEC O6: a superseded stream keeps no
    # slot), so it is read to its end rather than written to: a write may find the
    # call already finished.
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await old.read()
    assert raised.value.code() == grpc.StatusCode.ABORTED
    assert "s1" in await service.workers()  # the old stream's teardown removed nothing
    assert not await redis.exists(service.keys.detached("s1"))
    await new.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    assert (await _read(new)).HasField("heartbeat_ack")
    await new.write(affinity_pb2.AttachRequest(goodbye=affinity_pb2.Goodbye()))
    await new.done_writing()
    assert await new.code() == grpc.StatusCode.OK
    assert "s1" not in await service.workers()
    assert await redis.exists(service.keys.detached("s1"))


async def test_welcome_carries_the_heartbeat_interval_and_presence_ttl(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(heartbeat_interval_s=0.25, presence_ttl_s=1.5)
    credential = (await credentials.issue("s1")).credential
    call = await _attach(
        service, affinity_pb2.Hello(sandbox_id="s1", capacity=1, credential=credential)
    )
    welcome = (await _read(call)).welcome
    assert welcome.heartbeat_interval.ToMilliseconds() == 250
    assert welcome.presence_ttl.ToMilliseconds() == 1500
    call.cancel()


async def test_a_worker_with_invalid_settings_exits_2_without_attaching(
    affinity: StartAffinity, worker_process: StartWorkerProcess
) -> None:
    service = await affinity()
    proc = await worker_process(service.address, "w1", TURNSTILE_WORKER_TIER="not/a/label")
    assert await asyncio.wait_for(proc.proc.wait(), 15) == 2
    assert await service.workers() == {}


async def test_a_replica_shutting_down_ends_worker_streams_at_once_and_keeps_presence(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    # A grace far longer than the wait below: stop() only returns in time if the
    # drain hook ends the long-lived streams instead of waiting the grace out.
    leaving = await affinity(shutdown_grace_s=60)
    staying = await affinity()
    w1 = await worker(leaving.address, "w1")
    await w1.attached()
    await asyncio.wait_for(leaving.stop(), timeout=15)
    # No detach mark: a replica's restart is not the sandbox leaving; presence
    # stays until the worker attaches elsewhere or it expires.
    assert not await redis.exists(leaving.keys.detached("w1"))
    assert "w1" in await staying.workers()
