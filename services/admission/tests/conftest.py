"""Fixtures of the admission tests: the real service on a real socket, and the live
counts in Redis written the way the substrate's leader writes them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.app import create_app
from turnstile_admission.keys import AdmissionKeys
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED, UNSUPPORTED
from turnstile_contracts import admission_pb2_grpc
from turnstile_platform.server import GrpcService


@dataclass
class LiveSets:
    """The live counts a substrate leader keeps (``turnstile_clientkeys.live_counts``):
    each key's live set, and the marker that says whether they are current."""

    redis: aioredis.Redis
    keys: LiveCountKeys

    async def counted(self, key: str = "acme", *live: str) -> None:
        """The counts are current, and ``key``'s live sandboxes are ``live``."""
        await self.redis.delete(self.keys.live(key))
        if live:
            await self.redis.sadd(self.keys.live(key), *live)
        await self.redis.set(self.keys.state, COUNTED)

    async def unsupported(self) -> None:
        await self.redis.set(self.keys.state, UNSUPPORTED)

    async def unavailable(self) -> None:
        await self.redis.delete(self.keys.state)


@pytest.fixture
async def live(redis: aioredis.Redis, redis_prefix: str) -> LiveSets:
    """Live counts current and empty, as a healthy leader with no pods keeps them."""
    sets = LiveSets(redis, LiveCountKeys(redis_prefix))
    await sets.counted()
    return sets


@dataclass
class Running:
    app: GrpcService
    stub: admission_pb2_grpc.AdmissionServiceAsyncStub
    channel: grpc.aio.Channel
    settings: AdmissionSettings
    keys: AdmissionKeys = field(init=False)

    def __post_init__(self) -> None:
        self.keys = AdmissionKeys(self.settings.redis_prefix)


Start = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_admission(
    redis_url: str, redis_prefix: str, live: LiveSets
) -> AsyncIterator[Start]:
    """Start the admission service on a free port; settings may be overridden."""
    running: list[Running] = []

    async def start(**overrides: Any) -> Running:
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "port": 0,
            "metrics_port": 0,
            "shutdown_grace_s": 0,
            "log_format": "text",
            **overrides,
        }
        tracer_provider = values.pop("tracer_provider", None)
        settings = AdmissionSettings(**values)
        app = await create_app(settings, tracer_provider=tracer_provider)
        port = await app.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub: Any = admission_pb2_grpc.AdmissionServiceStub(channel)
        one = Running(app, stub, channel, settings)
        running.append(one)
        return one

    try:
        yield start
    finally:
        for one in running:
            await one.channel.close(None)
            await one.app.stop()


@pytest.fixture
async def admission(start_admission: Start) -> Running:
    """The admission service with default settings."""
    return await start_admission()
