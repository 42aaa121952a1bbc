"""Fixtures of the admission tests: the real service on a real socket, and a small
gRPC server standing in for the substrate's ``CountLiveSandboxes``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_admission.app import create_app
from turnstile_admission.keys import AdmissionKeys
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import admission_pb2_grpc, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.server import GrpcService


class CountingSubstrate(substrate_pb2_grpc.SubstrateServiceServicer):
    """Answers CountLiveSandboxes from ``live`` (bounded key → live sandbox ids)."""

    def __init__(self) -> None:
        self.live: dict[str, set[str]] = {}
        self.unknown = False
        self.requests: list[substrate_pb2.CountLiveSandboxesRequest] = []

    async def CountLiveSandboxes(
        self,
        request: substrate_pb2.CountLiveSandboxesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> substrate_pb2.CountLiveSandboxesResponse:
        self.requests.append(request)
        if self.unknown:
            return substrate_pb2.CountLiveSandboxesResponse(
                unknown=substrate_pb2.CountLiveSandboxesResponse.Unknown(
                    reason=substrate_pb2.UNKNOWN_REASON_UNSUPPORTED, detail="direct"
                )
            )
        live = self.live.get(request.key, set()) - {request.exclude_sandbox_id}
        seen = [i for i in request.pending_sandbox_ids if i in live]
        return substrate_pb2.CountLiveSandboxesResponse(
            known=substrate_pb2.CountLiveSandboxesResponse.Known(
                live=len(live), live_pending_sandbox_ids=seen
            )
        )


@dataclass
class Substrate:
    servicer: CountingSubstrate
    address: str


@pytest.fixture
async def substrate() -> AsyncIterator[Substrate]:
    servicer = CountingSubstrate()  # type: ignore[abstract]  # only the count
    server = grpc.aio.server()
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Substrate(servicer, f"127.0.0.1:{port}")
    finally:
        await server.stop(None)


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
    redis_url: str, redis_prefix: str, substrate: Substrate
) -> AsyncIterator[Start]:
    """Start the admission service on a free port; settings may be overridden."""
    running: list[Running] = []

    async def start(**overrides: Any) -> Running:
        values: dict[str, Any] = {
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "substrate_addr": substrate.address,
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
