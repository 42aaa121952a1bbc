"""Benchmark the Activate path on the Direct substrate, against ceilings measured in
the same run.

    uv run python services/substrate/bench/activate.py [--database-url URL]

Measures, all on 127.0.0.1 in this process:

* ceiling: a grpc.aio echo server (calls/s, 64 in flight);
* ``ALREADY_RUNNING``: Activate of running sandboxes — the hot path of every
  data-plane wake (a runtime lookup and one primary-key SELECT);
* cold activations: Activate of new sandboxes, each starting a real process
  (the idle runtime), writing the record, execution and receipt in one
  transaction and committing the hold; then Deactivate of them all.

Admission is a stand-in that admits everything (its own cost is admission's
benchmark). Needs PostgreSQL at ``--database-url`` (a scratch database is
created and dropped) and takes well under two minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import grpc.aio

from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_substrate.app import create_app
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings

IN_FLIGHT = 64
IDLE_RUNTIME = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"


class AdmitAll(admission_pb2_grpc.AdmissionServiceServicer):
    async def Admit(  # noqa: N802 - gRPC method name
        self, request: Any, context: Any
    ) -> admission_pb2.AdmitResponse:
        return admission_pb2.AdmitResponse(
            decision=admission_pb2.DECISION_ADMITTED,
            hold_id=uuid.uuid4().hex,
            key=common_pb2.BoundedKey(key="acme", kind=common_pb2.KEY_KIND_OWN),
        )

    async def CommitHold(  # noqa: N802 - gRPC method name
        self, request: Any, context: Any
    ) -> admission_pb2.CommitHoldResponse:
        return admission_pb2.CommitHoldResponse(committed=True)

    async def CancelHold(  # noqa: N802 - gRPC method name
        self, request: Any, context: Any
    ) -> admission_pb2.CancelHoldResponse:
        return admission_pb2.CancelHoldResponse(cancelled=True)

    async def ReleaseSandbox(  # noqa: N802 - gRPC method name
        self, request: Any, context: Any
    ) -> admission_pb2.ReleaseSandboxResponse:
        return admission_pb2.ReleaseSandboxResponse(released=True)

    async def GetUsage(  # noqa: N802 - gRPC method name
        self, request: Any, context: Any
    ) -> admission_pb2.GetUsageResponse:
        return admission_pb2.GetUsageResponse()


async def rate(call: Callable[[int], Awaitable[object]], total: int, in_flight: int) -> float:
    """Calls per second of ``call(i)`` for i in range(total), ``in_flight`` at a time."""
    queue = iter(range(total))

    async def worker() -> None:
        for i in queue:
            await call(i)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return total / (time.perf_counter() - started)


async def echo_ceiling(total: int) -> float:
    async def echo(request: bytes, context: Any) -> bytes:
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "E", {"M": grpc.unary_unary_rpc_method_handler(echo)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    method = channel.unary_unary("/E/M", request_serializer=None, response_deserializer=None)
    try:
        return await rate(lambda i: method(b"x" * 64), total, IN_FLIGHT)
    finally:
        await channel.close(None)
        await server.stop(None)


def bench_settings(url: str, admission_port: int, state: Path) -> SubstrateSettings:
    """The substrate under test: Direct runtimes that idle, on loopback in plaintext
    as the other benchmarks run (mTLS is priced in admission's)."""
    return SubstrateSettings.model_validate(
        {
            "port": 0,
            "metrics_port": 0,
            "database_url": url,
            "database_pool_max": 32,
            "admission_addr": f"127.0.0.1:{admission_port}",
            "direct_runtime_command": IDLE_RUNTIME,
            "direct_runtime_user": str(os.getuid()),
            "direct_state_dir": state,
            "log_level": "WARNING",
            "shutdown_grace_s": 1,
            "plaintext": True,
        }
    )


async def main(database_url: str) -> None:
    base, _, _ = database_url.rpartition("/")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{base}/{name}"
    state = Path(tempfile.mkdtemp(prefix="turnstile-bench-"))
    admission = grpc.aio.server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmitAll(), admission)
    admission_port = admission.add_insecure_port("127.0.0.1:0")
    await admission.start()
    try:
        await asyncio.to_thread(apply_migrations, url)
        app = await create_app(bench_settings(url, admission_port, state))
        await app.start()
        channel = grpc.aio.insecure_channel(app.address)
        stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
        client = common_pb2.ActivationClient(client_id="acme")

        def activate(sandbox_id: str) -> Awaitable[object]:
            request = substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=client)
            return stub.Activate(request)

        echo = [await echo_ceiling(3000) for _ in range(3)]

        cold_n = 120
        cold = await rate(lambda i: activate(f"sb-{i}"), cold_n, 16)
        running = [
            await rate(lambda i: activate(f"sb-{i % cold_n}"), 3000, IN_FLIGHT) for _ in range(3)
        ]
        stop = await rate(
            lambda i: stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=f"sb-{i}")),
            cold_n,
            16,
        )
        await channel.close(None)
        await app.stop()

        ceiling = statistics.median(echo)
        hot = statistics.median(running)
        print(f"echo ceiling (grpc.aio, {IN_FLIGHT} in flight):   {ceiling:8.0f} calls/s")
        print(
            f"Activate, ALREADY_RUNNING ({IN_FLIGHT} in flight): {hot:8.0f} calls/s"
            f"  = {hot / ceiling:.2f} x echo"
        )
        print(f"Activate, cold (process start, 16 in flight): {cold:8.0f} activations/s")
        print(f"Deactivate (SIGTERM + wait, 16 in flight):    {stop:8.0f} stops/s")
    finally:
        await admission.stop(None)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    asyncio.run(main(parser.parse_args().database_url))
