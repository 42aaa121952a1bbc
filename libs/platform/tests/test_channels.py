"""Peer channels: a default deadline on every unary call, retries only where idempotent,
and a caller that gives up cancels its call on the server."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_platform.channels import create_channel
from turnstile_platform.errors import RichError
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import SERVICE, add_probe, call, settings


async def _serve(methods: dict[str, Any]) -> GrpcService:
    app = GrpcService("probe", settings(), service_names=[])
    add_probe(app, methods)
    await app.start()
    return app


@pytest.mark.parametrize("timeout_s", [0.15, 0.5, 1.0, 3.0])
async def test_a_short_default_deadline_lets_fast_calls_through(timeout_s: float) -> None:
    async def pong(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return b"pong"

    app = await _serve({"Pong": pong})
    channel = create_channel(f"127.0.0.1:{app.port}", SERVICE, timeout_s=timeout_s)
    try:
        assert await call(channel, "Pong") == b"pong"
    finally:
        await channel.close(None)
        await app.stop()


async def test_a_call_slower_than_the_default_deadline_fails_with_deadline_exceeded() -> None:
    release = asyncio.Event()

    async def stall(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await release.wait()
        return b""

    app = await _serve({"Stall": stall})
    channel = create_channel(f"127.0.0.1:{app.port}", SERVICE, timeout_s=0.2)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(channel, "Stall")
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        release.set()
        await channel.close(None)
        await app.stop()


@pytest.mark.parametrize(("idempotent", "attempts"), [(True, 3), (False, 1)])
async def test_only_idempotent_methods_are_retried_on_unavailable(
    idempotent: bool, attempts: int
) -> None:
    seen: list[int] = []

    async def flaky(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        seen.append(1)
        if len(seen) < 3:
            raise RichError(code=grpc.StatusCode.UNAVAILABLE, message="not yet")
        return b"ok"

    app = await _serve({"Flaky": flaky})
    channel = create_channel(
        f"127.0.0.1:{app.port}",
        SERVICE,
        timeout_s=5,
        idempotent_methods=["Flaky"] if idempotent else [],
    )
    try:
        if idempotent:
            assert await call(channel, "Flaky") == b"ok"
        else:
            with pytest.raises(grpc.aio.AioRpcError):
                await call(channel, "Flaky")
    finally:
        await channel.close(None)
        await app.stop()
    assert len(seen) == attempts


@pytest.mark.parametrize("client_spans", [True, False])
async def test_a_caller_cancelled_mid_call_cancels_the_call_on_the_server(
    client_spans: bool,
) -> None:
    """The task awaiting a call is cancelled: the server's handler is cancelled too,
    with client spans as without (the span interceptor waits for the call's status,
    and a cancellation of that wait alone left the call running to its deadline)."""
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def wait(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b""

    app = await _serve({"Wait": wait})
    channel = create_channel(
        f"127.0.0.1:{app.port}", SERVICE, timeout_s=30, client_spans=client_spans
    )
    try:
        caller = asyncio.ensure_future(call(channel, "Wait"))
        await entered.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(cancelled.wait(), 5)
    finally:
        await channel.close(None)
        await app.stop()
