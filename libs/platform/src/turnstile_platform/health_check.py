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
    options: list[tuple[str, str]] | None = None,
) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``), ``UNREACHABLE``, or
    ``WRONG_IDENTITY`` (the server's certificate does not hold the identity
    ``options`` ask for, or is no server certificate: SPEC O5).

    ``service`` asks about one service name instead of the server as a whole: a
    server that does not serve it answers ``NOT_FOUND``, so a caller cannot
    mistake another service on the same address for the one it expects.

    ``credentials``: mTLS client credentials for a TLS port (none: plaintext, as
    on a ``health_port``); ``options``: the channel arguments that check the
    server's identity (:attr:`turnstile_platform.tls.ChannelCredentialsSource.options`)."""
    channel = (
        grpc.aio.secure_channel(target, credentials, options=options)
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
            if error.code() == grpc.StatusCode.UNAVAILABLE and wrong_server(error):
                return "WRONG_IDENTITY"
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNREACHABLE"
            return error.code().name
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


#: What gRPC's handshake says when the server's certificate is not the expected one:
#: the server name check failed, or the certificate may not serve (no serverAuth).
WRONG_SERVER_SIGNS = ("Hostname Verification Check failed", "unsupported certificate purpose")


def wrong_server(error: grpc.aio.AioRpcError) -> bool:
    """Whether ``error`` is a handshake refused for the server's identity."""
    details = error.details() or ""
    return any(sign in details for sign in WRONG_SERVER_SIGNS)


async def wait_serving(
    target: str,
    *,
    timeout_s: float,
    interval_s: float = 0.1,
    service: str = "",
    credentials: grpc.ChannelCredentials | None = None,
    options: list[tuple[str, str]] | None = None,
) -> bool:
    """Poll until ``target`` reports SERVING; False if it did not within ``timeout_s``.

    Polling, not ``Watch``: before the server exists there is no stream to watch,
    and a refused connection must be retried anyway.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        status = await check(
            target,
            timeout_s=min(1.0, timeout_s),
            service=service,
            credentials=credentials,
            options=options,
        )
        if status == "SERVING":
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(interval_s)
