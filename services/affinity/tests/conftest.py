"""Fixtures of the affinity tests: real Redis, the real service over gRPC, real workers.

``affinity`` starts the service in-process on a free port (more than one
replica may share a Redis prefix, as in production); ``worker`` starts a real
worker agent against it, in-process (its process dying does not matter) or as
a subprocess (``python -m turnstile_affinity.worker``) where it does.

Attestation is on, as in production: ``credentials`` mints sandbox credentials
the way the substrate does (its own key pair, the real issuer writing the real
Redis record), and the worker fixtures give each worker its sandbox's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_affinity.app import create_app
from turnstile_affinity.settings import AffinitySettings
from turnstile_affinity.store import AffinityStore, Clock, Keys
from turnstile_affinity.worker.agent import WorkerAgent
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform.errors import RichError, decode
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    Issued,
    PresenceClaims,
    SigningKey,
)
from turnstile_platform.server import GrpcService
from turnstile_testing.plugin import CredentialKeyFiles

UNSET: Any = object()

#: The client the fixtures' sandboxes and sessions belong to unless a test says otherwise.
TENANT = "acme"


@dataclass
class Affinity:
    """One running affinity replica and a client of it."""

    app: GrpcService
    settings: AffinitySettings
    clock: Clock
    channel: grpc.aio.Channel
    stub: affinity_pb2_grpc.AffinityServiceAsyncStub
    keys: Keys

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.app.port}"

    async def place(
        self, session_id: str, tier: str = "", client: str = TENANT
    ) -> affinity_pb2.PlaceResponse:
        return await self.stub.Place(
            affinity_pb2.PlaceRequest(session_id=session_id, tier=tier, client_id=client)
        )

    async def refused(self, session_id: str, tier: str = "", client: str = TENANT) -> RichError:
        """Place, expecting a refusal; returns it decoded."""
        try:
            response = await self.place(session_id, tier, client)
        except grpc.aio.AioRpcError as error:
            return decode(error)
        raise AssertionError(f"expected a refusal, got {response}")

    async def prepare(self, session_id: str, client: str = TENANT) -> affinity_pb2.PrepareResponse:
        return await self.stub.Prepare(
            affinity_pb2.PrepareRequest(session_id=session_id, client_id=client)
        )

    async def release(self, placed: affinity_pb2.PlaceResponse, client: str = TENANT) -> bool:
        request = affinity_pb2.ReleaseLeaseRequest(
            sandbox_id=placed.sandbox_id, lease_id=placed.lease_id, client_id=client
        )
        return (await self.stub.ReleaseLease(request)).released

    async def workers(self, tier: str = "", client: str = "") -> dict[str, affinity_pb2.Worker]:
        listed = await self.stub.ListWorkers(
            affinity_pb2.ListWorkersRequest(tier=tier, client_id=client)
        )
        return {w.sandbox_id: w for w in listed.workers}

    async def stop(self) -> None:
        await self.channel.close(None)
        await self.app.stop()


StartAffinity = Callable[..., Awaitable[Affinity]]


@dataclass
class Credentials:
    """Mints sandbox credentials as the substrate does, into files workers read."""

    issuer: CredentialIssuer
    keys: CredentialKeyFiles
    directory: Path
    issued: dict[str, Issued] = field(default_factory=dict)

    #: The presence each sandbox's credentials attest (the latest given).
    presences: dict[str, PresenceClaims | None] = field(default_factory=dict)

    async def issue(self, sandbox_id: str, presence: PresenceClaims | None = UNSET) -> Issued:
        """A new runtime's credential (a new generation, recorded in Redis), attesting
        ``presence``: unset, the sandbox's earlier one, else a capacity-4 sandbox of
        :data:`TENANT` in tier ``a``; None, no presence claims (an old credential)."""
        if presence is UNSET:
            presence = self.presences.get(sandbox_id, PresenceClaims(TENANT, "a", 4, ""))
        self.presences[sandbox_id] = presence
        issued = await self.issuer.issue(sandbox_id, presence=presence)
        self.issued[sandbox_id] = issued
        return issued

    async def renew(self, sandbox_id: str) -> Issued | None:
        """Renew the sandbox's latest credential, attesting the same presence."""
        return await self.issuer.renew(
            sandbox_id,
            self.issued[sandbox_id].generation,
            presence=self.presences.get(sandbox_id),
        )

    async def file(self, sandbox_id: str, presence: PresenceClaims | None = UNSET) -> Path:
        """A credential file for ``sandbox_id``: issued once, then the same file, until a
        runtime of another presence starts (as a new activation mints a new one)."""
        path = self.directory / f"{sandbox_id}.credential"
        changed = presence is not UNSET and self.presences.get(sandbox_id, UNSET) != presence
        if sandbox_id not in self.issued or changed:
            path.write_text((await self.issue(sandbox_id, presence)).credential)
        return path


@pytest.fixture
async def credentials(
    redis: aioredis.Redis,
    redis_prefix: str,
    credential_keys: CredentialKeyFiles,
    tmp_path_factory: pytest.TempPathFactory,
) -> Credentials:
    issuer = CredentialIssuer(
        SigningKey.from_file(credential_keys.signing_key_file), redis, redis_prefix, ttl_s=3600
    )
    return Credentials(issuer, credential_keys, tmp_path_factory.mktemp("credentials"))


@pytest.fixture
async def affinity(
    redis_url: str, redis_prefix: str, credentials: Credentials
) -> AsyncIterator[StartAffinity]:
    """Start affinity replicas sharing this test's Redis prefix; stopped at the end."""
    running: list[Affinity] = []

    async def start(clock: Clock | None = None, **overrides: Any) -> Affinity:
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "port": 0,
            "metrics_port": 0,
            "wake_enabled": False,
            "heartbeat_interval_s": 0.2,
            "presence_ttl_s": 5.0,
            "shutdown_grace_s": 0.2,
            "log_format": "text",
            "worker_credential_public_keys_file": credentials.keys.public_keys_file,
        }
        values.update(overrides)
        settings = AffinitySettings(**values)
        clock = clock or Clock()
        app = await create_app(settings, clock=clock)
        await app.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.port}")
        stub: affinity_pb2_grpc.AffinityServiceAsyncStub = affinity_pb2_grpc.AffinityServiceStub(
            channel
        )
        replica = Affinity(app, settings, clock, channel, stub, Keys(redis_prefix))
        running.append(replica)
        return replica

    yield start
    for replica in reversed(running):
        await replica.stop()


@dataclass
class Worker:
    """A worker agent running in this process."""

    agent: WorkerAgent
    task: asyncio.Task[None]

    @property
    def sandbox_id(self) -> str:
        assert self.agent.sandbox_id is not None, "the worker has not learnt its sandbox id yet"
        return self.agent.sandbox_id

    async def attached(self, timeout: float = 10) -> None:
        await asyncio.wait_for(self.agent.attached.wait(), timeout)

    async def welcomed(self, count: int, timeout: float = 30) -> None:
        """Wait until the relay has welcomed ``count`` streams of this worker; an
        agent that stopped on an error fails the wait with that error at once."""
        welcomed = asyncio.ensure_future(self.agent.welcomed(count))
        try:
            done, _ = await asyncio.wait(
                {welcomed, self.task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            welcomed.cancel()
        if self.task in done:
            self.task.result()  # raises the agent's error
            raise AssertionError(f"the agent returned after {self.agent.welcomes} welcomes")
        if welcomed not in done:
            raise TimeoutError(f"{self.agent.welcomes} of {count} welcomes after {timeout}s")

    async def detached(self, timeout: float = 10) -> None:
        """Wait until the worker has noticed that its welcomed stream ended."""
        await asyncio.wait_for(self.agent.detached.wait(), timeout)

    async def stop(self) -> None:
        """SIGTERM's path: Goodbye, then the agent returns."""
        self.agent.stop.set()
        await asyncio.wait_for(self.task, 10)


StartWorker = Callable[..., Awaitable[Worker]]


@pytest.fixture
async def worker(credentials: Credentials) -> AsyncIterator[StartWorker]:
    """Start in-process worker agents (attached when returned); stopped at the end.

    Each gets its sandbox's credential file unless ``credential_file`` is given.
    """
    running: list[Worker] = []

    async def start(
        address: str,
        sandbox_id: str | None,
        tier: str | None = UNSET,
        *,
        capacity: int = 4,
        wait: bool = True,
        client: str = TENANT,
        **overrides: Any,
    ) -> Worker:
        """``sandbox_id=None``: the worker reads it from ``sandbox_id_file`` (an override).

        The sandbox's credential attests what the worker declares (its tier label,
        capacity and endpoint) and ``client`` as its owner, as the substrate's would."""
        values: dict[str, Any] = {
            "sandbox_id": sandbox_id,
            "capacity": capacity,
            "affinity_addr": address,
            "reconnect_initial_s": 0.05,
            "reconnect_max_s": 0.2,
        }
        if tier is not UNSET:
            values["tier"] = tier
        values.update(overrides)
        settings = WorkerSettings(**values)
        if sandbox_id is not None and "credential_file" not in overrides:
            presence = PresenceClaims(
                client, settings.tier_label or "", settings.capacity, settings.endpoint
            )
            values["credential_file"] = await credentials.file(sandbox_id, presence)
            settings = WorkerSettings(**values)
        agent = WorkerAgent(settings)
        handle = Worker(agent, asyncio.create_task(agent.run()))
        running.append(handle)
        if wait:
            await handle.attached()
        return handle

    yield start
    for handle in running:
        handle.agent.stop.set()
    for handle in running:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.task, 10)


@dataclass
class WorkerProcess:
    """``python -m turnstile_affinity.worker`` as a child process."""

    proc: asyncio.subprocess.Process
    sandbox_id: str
    lines: list[dict[str, Any]] = field(default_factory=list)

    async def wait_for_log(self, message: str, timeout: float = 60) -> dict[str, Any]:
        """Read the agent's JSON log lines until one has ``message``."""
        assert self.proc.stderr is not None
        async with asyncio.timeout(timeout):
            while True:
                raw = await self.proc.stderr.readline()
                if not raw:
                    raise AssertionError(f"worker exited before logging {message!r}: {self.lines}")
                with contextlib.suppress(ValueError):
                    line: dict[str, Any] = json.loads(raw)
                    self.lines.append(line)
                    if line.get("message") == message:
                        return line

    async def terminate(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return await asyncio.wait_for(self.proc.wait(), 15)


StartWorkerProcess = Callable[..., Awaitable[WorkerProcess]]


@pytest.fixture
async def worker_process(credentials: Credentials) -> AsyncIterator[StartWorkerProcess]:
    """Start worker agents as subprocesses (each with its sandbox's credential file);
    killed at the end if still running."""
    running: list[WorkerProcess] = []

    async def start(address: str, sandbox_id: str, **env: str) -> WorkerProcess:
        """``sandbox_id=""`` sets no ``TURNSTILE_WORKER_SANDBOX_ID`` (give its file in ``env``)."""
        environment = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TURNSTILE_WORKER_", "TURNSTILE_AFFINITY_ADDR"))
        }
        if sandbox_id:
            environment["TURNSTILE_WORKER_SANDBOX_ID"] = sandbox_id
            path = await credentials.file(sandbox_id)
            environment["TURNSTILE_WORKER_CREDENTIAL_FILE"] = str(path)
        environment.update(
            {
                "TURNSTILE_AFFINITY_ADDR": address,
                "TURNSTILE_WORKER_RECONNECT_MAX_S": "0.2",
                "TURNSTILE_LOG_FORMAT": "json",
                **env,
            }
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "turnstile_affinity.worker",
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        handle = WorkerProcess(proc, sandbox_id)
        running.append(handle)
        return handle

    yield start
    for handle in running:
        if handle.proc.returncode is None:
            handle.proc.kill()
            await handle.proc.wait()


@pytest.fixture
def store(redis: aioredis.Redis, redis_prefix: str) -> AffinityStore:
    """The store itself, for script tests (its clock starts at offset 0)."""
    return AffinityStore(redis, redis_prefix, Clock())
