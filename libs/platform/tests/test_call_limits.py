"""Unary calls and streams have limits of their own (SPEC F6), over a real socket."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_platform.call_limits import UNCOUNTED_ROOM, CallKind
from turnstile_platform.errors import RichError, decode
from turnstile_platform.server import GrpcService
from turnstile_platform.settings import ServiceSettings

Context = grpc.aio.ServicerContext[Any, Any]


class Held:
    """A server whose unary ``Hold`` and stream ``Watch`` stay open until released."""

    def __init__(self, unary: int, streams: int, waiting: int = 0) -> None:
        settings = ServiceSettings(
            port=0, max_concurrent_rpcs=unary, max_concurrent_streams=streams, log_format="text"
        )
        self.app = GrpcService(
            "limits-test",
            settings,
            service_names=["test.Limits"],
            self_admitted_streams={"/test.Limits/Admit": waiting} if waiting else None,
        )
        self.release = asyncio.Event()
        self.entered = 0
        self.entered_changed = asyncio.Condition()
        handler = grpc.method_handlers_generic_handler(
            "test.Limits",
            {
                "Hold": grpc.unary_unary_rpc_method_handler(self._hold),
                "Watch": grpc.stream_stream_rpc_method_handler(self._watch),
                "Admit": grpc.stream_stream_rpc_method_handler(self._admit),
            },
        )
        self.app.server.add_generic_rpc_handlers((handler,))

    async def _entered(self) -> None:
        async with self.entered_changed:
            self.entered += 1
            self.entered_changed.notify_all()

    async def _hold(self, request: bytes, context: Context) -> bytes:
        await self._entered()
        if request == b"hold":
            await self.release.wait()
        return request

    async def _watch(
        self, requests: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[bytes]:
        await self._entered()
        yield b"open"
        async for request in requests:
            yield request

    async def _admit(
        self, requests: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[bytes]:
        """Takes its stream slot itself, at its first message (as the relay's Attach)."""
        await self._entered()
        if await anext(requests, None) is None:
            return
        self.app.limits.acquire(CallKind.STREAM, "Admit")
        try:
            yield b"admitted"
            async for request in requests:
                yield request
        finally:
            self.app.limits.release(CallKind.STREAM)

    async def until_entered(self, count: int) -> None:
        async with self.entered_changed:
            await asyncio.wait_for(self.entered_changed.wait_for(lambda: self.entered >= count), 30)


@pytest.fixture
async def held() -> AsyncIterator[Any]:
    servers: list[Held] = []

    async def start(unary: int, streams: int, waiting: int = 0) -> tuple[Held, grpc.aio.Channel]:
        server = Held(unary, streams, waiting)
        await server.app.start()
        servers.append(server)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.app.port}")
        channels.append(channel)
        return server, channel

    channels: list[grpc.aio.Channel] = []
    yield start
    for server in servers:
        server.release.set()
    for channel in channels:
        await channel.close(None)
    for server in servers:
        await server.app.stop()


def _refusal(error: grpc.aio.AioRpcError, kind: str, limit: int) -> RichError:
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    rich = decode(error)
    assert rich.reason == "CONCURRENCY_LIMITED"
    assert rich.metadata["kind"] == kind
    assert rich.metadata["limit"] == str(limit)
    assert rich.retry_after_s is not None
    assert rich.retry_after_s > 0
    return rich


async def test_streams_past_the_unary_limit_leave_unary_calls_free_and_the_next_stream_is_refused(
    held: Any,
) -> None:
    _server, channel = await held(unary=2, streams=5)
    watch = channel.stream_stream("/test.Limits/Watch")
    hold = channel.unary_unary("/test.Limits/Hold")
    streams = [watch() for _ in range(5)]
    for stream in streams:
        assert await stream.read() == b"open"
    # Five streams, more than the unary limit of two: unary calls still go through.
    assert await asyncio.gather(*(hold(b"quick") for _ in range(2))) == [b"quick", b"quick"]
    refused = watch()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await refused.read()
    rich = _refusal(raised.value, "stream", 5)
    assert rich.metadata["method"] == "Watch"
    # A stream that ends frees its slot for the next one (the slot is released
    # before the stream's status is sent).
    await streams[0].done_writing()
    assert await streams[0].code() == grpc.StatusCode.OK
    again = watch()
    assert await again.read() == b"open"
    for stream in [*streams[1:], again]:
        stream.cancel()


async def test_unary_calls_past_their_limit_are_refused_while_streams_still_open(
    held: Any,
) -> None:
    server, channel = await held(unary=2, streams=3)
    watch = channel.stream_stream("/test.Limits/Watch")
    hold = channel.unary_unary("/test.Limits/Hold")
    holding = [asyncio.ensure_future(hold(b"hold")) for _ in range(2)]
    await server.until_entered(2)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await hold(b"quick")
    _refusal(raised.value, "unary", 2)
    stream = watch()
    assert await stream.read() == b"open"
    await stream.write(b"ping")
    assert await stream.read() == b"ping"
    server.release.set()
    assert await asyncio.gather(*holding) == [b"hold", b"hold"]
    assert await hold(b"quick") == b"quick"
    stream.cancel()


async def test_the_in_flight_gauge_reads_the_calls_being_served(held: Any) -> None:
    from prometheus_client import REGISTRY

    def in_flight() -> float:
        value = REGISTRY.get_sample_value("turnstile_grpc_server_in_flight", {"kind": "unary"})
        assert value is not None
        return value

    server, channel = await held(unary=5, streams=5)
    hold = channel.unary_unary("/test.Limits/Hold")
    before = in_flight()
    holding = [asyncio.ensure_future(hold(b"hold")) for _ in range(3)]
    await server.until_entered(3)
    assert in_flight() == before + 3
    server.release.set()
    await asyncio.gather(*holding)
    assert in_flight() == before


async def test_a_self_admitted_stream_holds_no_slot_until_its_handler_takes_one(
    held: Any,
) -> None:
    server, channel = await held(unary=1, streams=1, waiting=4)
    # Each limit of one, with room for the seats the four levels (one assured
    # each) may take back from borrowers; the streams waiting to take theirs; room
    # for health and reflection.
    assert server.app.limits.server_cap == 2 * (1 + 4) + 4 + UNCOUNTED_ROOM
    admit = channel.stream_stream("/test.Limits/Admit")
    # Three streams past the stream limit of one are served: none has a slot yet.
    waiting = [admit() for _ in range(3)]
    await server.until_entered(3)
    await waiting[0].write(b"hello")
    assert await waiting[0].read() == b"admitted"
    # The next to take its slot finds the limit held, and is refused as any stream is.
    await waiting[1].write(b"hello")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await waiting[1].read()
    assert _refusal(raised.value, "stream", 1).metadata["method"] == "Admit"
    # A stream that ends gives its slot back.
    await waiting[0].done_writing()
    assert await waiting[0].code() == grpc.StatusCode.OK
    await waiting[2].write(b"hello")
    assert await waiting[2].read() == b"admitted"
    waiting[2].cancel()
