"""Two tenants on one Turnstile (SPEC O1): the real admission and substrate services in
this process, over mutual TLS with real certificates, on the test's own Redis prefix
and PostgreSQL database, with Direct runtimes.

Tenants are ``client/acme`` and ``client/globex``, each scoped to ``self`` and granted
every method that names a sandbox or a client — so what keeps them apart is ownership,
not the method grant. ``operator/ops`` may do everything for every client (``any``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.authz import RedisState, postgres_snapshot, redis_state
from turnstile_testing.pki import Identity, Pki

IDLE_RUNTIME = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"
TD = "spiffe://turnstile.test"
ADMISSION = "turnstile.admission.v1.AdmissionService"
ADMIN = "turnstile.admission.v1.AdminService"
SUBSTRATE = "turnstile.substrate.v1.SubstrateService"

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/substrate"]
methods = ["{ADMISSION}/*"]
clients = "any"

[[allow]]
identities = ["{TD}/operator/*"]
methods = ["*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = [
  "{SUBSTRATE}/Activate", "{SUBSTRATE}/Deactivate", "{SUBSTRATE}/GetSandbox",
  "{SUBSTRATE}/ListSandboxes",
  "{ADMISSION}/Admit", "{ADMISSION}/GetUsage", "{ADMISSION}/ReleaseSandbox",
  "{ADMISSION}/GetQueuePosition", "{ADMISSION}/ListDecisions",
]
clients = "self"
"""


def client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


INHERIT = common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())


#: The live counts' marker: the substrate's leader renews its expiry every few
#: seconds whatever the calls do (its heartbeat), so a renewal between two
#: snapshots of a slow test is no change a call made; a rewritten value still is.
LIVE_STATE_SUFFIX = b"live-state"


@dataclass(frozen=True)
class Snapshot:
    redis: RedisState
    postgres: dict[str, list[tuple[Any, ...]]]
    running: frozenset[str]

    def changes_since(self, before: Snapshot) -> dict[str, object]:
        """What changed since ``before`` (empty: nothing); Redis keys that expired on
        their own are no change."""
        changes: dict[str, object] = {}
        redis = {
            key: change
            for key, change in self.redis.changes_since(before.redis).items()
            if not (key.endswith(LIVE_STATE_SUFFIX) and change == "expiry changed")
        }
        if redis:
            changes["redis"] = redis
        if self.postgres != before.postgres:
            changes["postgres"] = {
                table: rows
                for table, rows in self.postgres.items()
                if rows != before.postgres.get(table)
            }
        if self.running != before.running:
            changes["running"] = self.running ^ before.running
        return changes


@dataclass
class Tenants:
    """The two services and a channel per identity."""

    admission: GrpcService
    substrate: GrpcService
    database_url: str
    redis: aioredis.Redis
    redis_prefix: str
    state_dir: Path
    channels: dict[str, grpc.aio.Channel]

    async def call(self, who: str, service: str, method: str, request: Any) -> Any:
        """Call ``method`` as ``who`` (acme, globex, ops); raises ``AioRpcError``."""
        address = self.substrate.address if service == SUBSTRATE else self.admission.address
        channel = self.channels[f"{who}@{address}"]
        response_types: dict[str, Any] = {
            "Activate": substrate_pb2.ActivateResponse,
            "Deactivate": substrate_pb2.DeactivateResponse,
            "GetSandbox": substrate_pb2.GetSandboxResponse,
            "ListSandboxes": substrate_pb2.ListSandboxesResponse,
            "CountLiveSandboxes": substrate_pb2.CountLiveSandboxesResponse,
            "Admit": admission_pb2.AdmitResponse,
            "GetUsage": admission_pb2.GetUsageResponse,
            "GetQueuePosition": admission_pb2.GetQueuePositionResponse,
            "ReleaseSandbox": admission_pb2.ReleaseSandboxResponse,
            "CommitHold": admission_pb2.CommitHoldResponse,
            "CancelHold": admission_pb2.CancelHoldResponse,
            "ListDecisions": admission_pb2.ListDecisionsResponse,
            **{
                m.name: getattr(admission_pb2, m.output_type.name)
                for m in admission_pb2.DESCRIPTOR.services_by_name["AdminService"].methods
            },
        }
        rpc = channel.unary_unary(
            f"/{service}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_types[method].FromString,
        )
        return await rpc(request, timeout=20)

    async def activate(
        self, who: str, sandbox_id: str, charged: common_pb2.ActivationClient
    ) -> substrate_pb2.ActivateResponse:
        request = substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=charged)
        response: substrate_pb2.ActivateResponse = await self.call(
            who, SUBSTRATE, "Activate", request
        )
        return response

    async def deactivate(self, who: str, sandbox_id: str) -> None:
        request = substrate_pb2.DeactivateRequest(sandbox_id=sandbox_id)
        await self.call(who, SUBSTRATE, "Deactivate", request)

    async def snapshot(self) -> Snapshot:
        """Everything a call could change: every Redis key under the prefix (DUMP and
        expiry), every PostgreSQL row, and which runtimes run (by sandbox id)."""
        return Snapshot(
            await redis_state(self.redis, self.redis_prefix),
            await postgres_snapshot(self.database_url),
            frozenset(runtime_ids(self.state_dir)),
        )


def runtime_pids(state_dir: Path) -> dict[str, int]:
    """Live runtime processes under ``state_dir`` by sandbox id, from /proc (the truth,
    whatever the substrate believes): a process whose cwd is a sandbox's workspace."""
    found: dict[str, int] = {}
    root = str(state_dir.absolute())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:
            continue
        if cwd.startswith(root + os.sep) and cwd.endswith(f"{os.sep}workspace"):
            found[Path(cwd).parent.name] = int(entry.name)
    return found


def runtime_ids(state_dir: Path) -> set[str]:
    """Sandboxes whose runtime process lives."""
    return set(runtime_pids(state_dir))


@pytest.fixture
def substrate_overrides() -> dict[str, Any]:
    """Settings of the substrate a test module changes (by overriding this fixture)."""
    return {}


@pytest.fixture
async def tenants(
    substrate_overrides: dict[str, Any],
    pki: Pki,
    redis_url: str,
    redis_prefix: str,
    redis: aioredis.Redis,
    database_url: str,
    tmp_path: Path,
) -> AsyncIterator[Tenants]:
    await asyncio.to_thread(apply_migrations, database_url)
    admission_values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "client_allowlist": ("acme", "globex"),
        "shutdown_grace_s": 0,
        "log_format": "text",
        "cap": {"default_cap": 10_000},
        "rate": {"default_burst": 100_000, "cluster_burst": 100_000},
        "concurrency": {"default_limit": 10_000},
        **pki.server_settings("service/admission", policy=POLICY),
    }
    admission = await create_admission(AdmissionSettings(**admission_values))
    await admission.start()
    worker = pki.identity("sandbox")
    state_dir = tmp_path / "direct"
    substrate_values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "database_url": database_url,
        "database_pool_max": 20,
        "admission_addr": admission.address,
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "substrate_kind": "direct",
        "direct_runtime_command": IDLE_RUNTIME,
        "direct_runtime_user": str(os.getuid()),  # about owners, not uids (SPEC O4)
        "direct_state_dir": state_dir,
        "direct_stop_grace_s": 5.0,
        "direct_worker_tls_cert_file": worker.cert_file,
        "direct_worker_tls_key_file": worker.key_file,
        "shutdown_grace_s": 1.0,
        "health_check_interval_s": 0.2,
        "log_format": "text",
        **pki.server_settings("service/substrate", policy=POLICY),
        **substrate_overrides,
    }
    substrate = await create_substrate(SubstrateSettings(**substrate_values))
    await substrate.start()
    identities: dict[str, Identity] = {
        "acme": pki.identity("client/acme"),
        "globex": pki.identity("client/globex"),
        "ops": pki.identity("operator/ops"),
    }
    channels = {
        f"{who}@{address}": identity.channel(address)
        for who, identity in identities.items()
        for address in (admission.address, substrate.address)
    }
    try:
        yield Tenants(admission, substrate, database_url, redis, redis_prefix, state_dir, channels)
    finally:
        for channel in channels.values():
            await channel.close(None)
        await substrate.stop()
        await admission.stop()
        for pid in runtime_pids(state_dir).values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


async def rows(database_url: str, query: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(query, *args)
    finally:
        await conn.close()
