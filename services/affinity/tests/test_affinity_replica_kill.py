"""An affinity replica killed with many workers attached (SPEC F6).

Three affinity replicas run as processes sharing one Redis prefix; the workers
are real worker agents in a load-generator process of their own
(``bench/attach_load.py agents``), each choosing a replica at random among the
three addresses as it would among a headless Service's. One replica is killed
with SIGKILL: its workers reattach to the other two, every session keeps its
sandbox (an affinity hit, no reset) within the grace, and each sandbox has one
presence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform.errors import decode
from turnstile_testing.processes import free_port

if TYPE_CHECKING:
    from conftest import Credentials

LOAD = Path(__file__).parents[1] / "bench" / "attach_load.py"


class Replica:
    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.port = port
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub: affinity_pb2_grpc.AffinityServiceAsyncStub = (
            affinity_pb2_grpc.AffinityServiceStub(self.channel)
        )

    async def workers(self) -> dict[str, affinity_pb2.Worker]:
        listed = await self.stub.ListWorkers(affinity_pb2.ListWorkersRequest(), timeout=30)
        workers = {w.sandbox_id: w for w in listed.workers}
        assert len(workers) == len(listed.workers), "a sandbox listed twice"
        return workers


@pytest.fixture
async def replicas(
    redis_url: str, redis_prefix: str, credentials: Credentials
) -> AsyncIterator[list[Replica]]:
    started: list[Replica] = []
    try:
        for _ in range(3):
            port = free_port()
            env = {
                **os.environ,
                "TURNSTILE_PORT": str(port),
                "TURNSTILE_METRICS_PORT": "0",
                "TURNSTILE_REDIS_URL": redis_url,
                "TURNSTILE_REDIS_PREFIX": redis_prefix,
                "TURNSTILE_WAKE_ENABLED": "false",
                "TURNSTILE_HEARTBEAT_INTERVAL_S": "2",
                "TURNSTILE_PRESENCE_TTL_S": "30",
                "TURNSTILE_GRACE_S": "120",
                "TURNSTILE_LOG_LEVEL": "WARNING",
                "TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE": str(
                    credentials.keys.public_keys_file
                ),
                "OTEL_TRACES_EXPORTER": "none",
            }
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "turnstile_affinity",
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
            )
            started.append(Replica(proc, port))
        for replica in started:
            await asyncio.wait_for(replica.channel.channel_ready(), 60)
        yield started
    finally:
        # Also when start-up failed: no replica outlives the test.
        for replica in started:
            await replica.channel.close(None)
            if replica.proc.returncode is None:
                replica.proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(replica.proc.wait(), 15)
            if replica.proc.returncode is None:
                replica.proc.kill()
                await replica.proc.wait()


class Fleet:
    """The load generator's worker agents, as its status lines report them."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.status: dict[str, int] = {"attached": 0, "welcomes": 0}

    async def until(self, what: str, predicate: Any, timeout: float) -> dict[str, int]:
        """The first status for which ``predicate`` holds; a timeout says which wait
        it was, how long it took and the last status (so a stall is told apart)."""
        assert self.proc.stdout is not None
        started = asyncio.get_running_loop().time()
        try:
            async with asyncio.timeout(timeout):
                while not predicate(self.status):
                    line = await self.proc.stdout.readline()
                    if not line:
                        raise AssertionError(f"the load generator exited at {self.status}")
                    self.status = json.loads(line)
        except TimeoutError:
            waited = asyncio.get_running_loop().time() - started
            raise AssertionError(f"{what}: not after {waited:.0f} s, at {self.status}") from None
        return self.status


async def place(stub: affinity_pb2_grpc.AffinityServiceAsyncStub, session: str) -> Any:
    """A Place as a client makes it: one a busy replica shed (UNAVAILABLE, nothing
    done, with its retry hint; the 3,000-worker run on a loaded machine) is sent again."""
    request = affinity_pb2.PlaceRequest(client_id="acme", session_id=session, tier="")
    attempts = 0
    while True:
        try:
            return await stub.Place(request, timeout=30)
        except grpc.aio.AioRpcError as error:
            attempts += 1
            shed = decode(error)
            if shed.code != grpc.StatusCode.UNAVAILABLE or attempts >= PLACE_ATTEMPTS:
                raise
            await asyncio.sleep(shed.retry_after_s or 0.1)  # the server's own hint


PLACE_ATTEMPTS = 20


@pytest.mark.timeout(600)
@pytest.mark.parametrize("count", [300, pytest.param(3000, marks=pytest.mark.slow)])
async def test_a_killed_replicas_workers_reattach_elsewhere_keeping_sessions_and_one_presence(
    count: int,
    replicas: list[Replica],
    credentials: Credentials,
    redis: aioredis.Redis,
    redis_prefix: str,
) -> None:
    ids = [f"w{i}" for i in range(count)]
    for start in range(0, count, 100):
        await asyncio.gather(*(credentials.file(i) for i in ids[start : start + 100]))
    target = "ipv4:" + ",".join(f"127.0.0.1:{r.port}" for r in replicas)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(LOAD),
        "agents",
        "--target",
        target,
        "--count",
        str(count),
        "--credentials-dir",
        str(credentials.directory),
        "--reconnect-initial",
        "1.0",
        "--reconnect-max",
        "4.0",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "TURNSTILE_LOG_LEVEL": "ERROR", "OTEL_TRACES_EXPORTER": "none"},
    )
    fleet = Fleet(proc)
    try:
        await fleet.until("every worker attached", lambda s: s["attached"] == count, 180)
        survivor = replicas[1]
        assert set(await survivor.workers()) == set(ids)
        # One session per sandbox, placed before the kill.
        sessions: dict[str, str] = {}
        for n in range(count):
            placed = await place(survivor.stub, f"chat-{n}")
            sessions[f"chat-{n}"] = placed.sandbox_id
            await survivor.stub.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(
                    sandbox_id=placed.sandbox_id, lease_id=placed.lease_id
                ),
                timeout=30,
            )
        welcomes_before = fleet.status["welcomes"]
        killed = replicas[0]
        killed.proc.kill()
        await killed.proc.wait()
        # Its workers lose their streams, then all are attached again, elsewhere.
        await fleet.until("a worker lost its stream", lambda s: s["attached"] < count, 120)
        status = await fleet.until(
            "every worker attached again", lambda s: s["attached"] == count, 180
        )
        reattached = status["welcomes"] - welcomes_before
        assert reattached > 0
        # Workers of the surviving replicas kept their streams: the kill moved only
        # the killed replica's, roughly a third of them.
        assert reattached < count
        # One presence per sandbox, seen alike from both survivors.
        listed = await survivor.workers()
        assert set(listed) == set(ids)
        assert set(await replicas[2].workers()) == set(ids)
        # Every session keeps its sandbox: an affinity hit, no workspace reset.
        for session, sandbox in sessions.items():
            placed = await place(replicas[2].stub, session)
            assert placed.sandbox_id == sandbox
            assert placed.outcome == affinity_pb2.PLACEMENT_OUTCOME_HIT
            assert not placed.HasField("reset")
            await replicas[2].stub.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(sandbox_id=sandbox, lease_id=placed.lease_id),
                timeout=30,
            )
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
