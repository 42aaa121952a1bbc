"""The real substrate service in the test's own process, with Direct runtimes (idle
processes of this interpreter), admitting through a real admission service: for the
tests that drive an activation end to end without a cluster."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc.aio

from turnstile_contracts import substrate_pb2, substrate_pb2_grpc
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings

#: A runtime that starts and idles until stopped.
IDLE_RUNTIME = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"


def direct_substrate_settings(
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    admission_addr: str,
    state_dir: Path,
    /,
    **overrides: Any,
) -> SubstrateSettings:
    """A test's substrate settings: loopback, free ports, the test's database, Redis
    and prefix, Direct runtimes of this user under ``state_dir``, text logs;
    ``overrides`` win."""
    return SubstrateSettings.model_validate(
        {
            "host": "127.0.0.1",
            "port": 0,
            "metrics_port": 0,
            "database_url": database_url,
            "admission_addr": admission_addr,
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "substrate_kind": "direct",
            "direct_runtime_command": IDLE_RUNTIME,
            "direct_runtime_user": str(os.getuid()),
            "direct_state_dir": state_dir,
            "direct_stop_grace_s": 5.0,
            "shutdown_grace_s": 1.0,
            "log_format": "text",
            **overrides,
        }
    )


@asynccontextmanager
async def running_substrate(settings: SubstrateSettings) -> AsyncIterator[GrpcService]:
    """The substrate started with ``settings`` on a migrated database; on leaving,
    the sandboxes still running are deactivated (their runtimes stopped), then the
    service stops."""
    await asyncio.to_thread(apply_migrations, str(settings.database_url))
    app = await create_app(settings)
    await app.start()
    try:
        yield app
    finally:
        async with grpc.aio.insecure_channel(app.address) as channel:
            stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
            listed = await stub.ListSandboxes(substrate_pb2.ListSandboxesRequest(page_size=100))
            for sandbox in listed.sandboxes:
                await stub.Deactivate(
                    substrate_pb2.DeactivateRequest(sandbox_id=sandbox.sandbox_id)
                )
        await app.stop()
