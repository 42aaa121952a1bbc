"""Client-side gRPC health checks: what the CLI's ``status`` and ``up`` and the test
kit ask of a running service."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc


async def check(
    target: str,
    *,
    timeout_s: float = 1.0,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``) or ``UNREACHABLE``.

    ``service`` asks about one service name instead of the server as a whole: a
    server that does not serve it answers ``NOT_FOUND``, so a caller cannot
    mistake another service on the same address for the one it expects.

    ``credentials``: mTLS client credentials for a TLS port (none: plaintext, as
    on a ``health_port``)."""
    channel = (
        grpc.aio.secure_channel(target, credentials)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNREACHABLE"
            return error.code().name
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


async def wait_serving(
    target: str,
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
) -> bool:
    """Poll until ``target`` reports SERVING; False if it did not within ``timeout_s``.

    Polling, not ``Watch``: before the server exists there is no stream to watch,
    and a refused connection must be retried anyway.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        status = await check(
            target, timeout_s=min(1.0, timeout_s), service=service, credentials=credentials
        )
        if status == "SERVING":
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(interval_s)
