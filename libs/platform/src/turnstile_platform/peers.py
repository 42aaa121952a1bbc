"""Typed stubs for calling the other Turnstile services.

Which methods are idempotent (safe for gRPC to retry on UNAVAILABLE) is declared
here, once, next to the service they belong to. Admit and Activate are not
retried by the channel: a retry after a lost response could take a second hold
or create a second runtime; their callers decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc.aio
from opentelemetry import trace

from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    affinity_pb2,
    affinity_pb2_grpc,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.channels import create_channel

ADMISSION = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
SUBSTRATE = substrate_pb2.DESCRIPTOR.services_by_name["SubstrateService"].full_name
AFFINITY = affinity_pb2.DESCRIPTOR.services_by_name["AffinityService"].full_name

IDEMPOTENT = {
    ADMISSION: ("CommitHold", "CancelHold", "ReleaseSandbox", "GetUsage"),
    SUBSTRATE: ("Deactivate", "CountLiveSandboxes", "GetSandbox", "ListSandboxes"),
    AFFINITY: ("ReleaseLease", "GetSession", "ListWorkers"),
}


StubT = TypeVar("StubT")


class PeerSettings(Protocol):
    """What a peer channel reads from settings. ``ServiceSettings`` has all of it;
    ``turnstilectl`` passes a plain object, so a command does not import pydantic."""

    @property
    def admission_addr(self) -> str: ...
    @property
    def substrate_addr(self) -> str: ...
    @property
    def affinity_addr(self) -> str: ...
    @property
    def rpc_timeout_s(self) -> float: ...
    @property
    def max_message_bytes(self) -> int: ...


@dataclass
class Peer(Generic[StubT]):
    """A stub and the channel it owns; close the channel when done."""

    stub: StubT
    channel: grpc.aio.Channel

    async def close(self) -> None:
        await self.channel.close(grace=None)


def _async(stub: Any) -> Any:
    """A stub built on a grpc.aio channel is the async stub of mypy-protobuf's types
    (its methods return awaitables); the generated constructor cannot say so."""
    return stub


def _channel(
    target: str,
    service: str,
    settings: PeerSettings,
    provider: trace.TracerProvider | None,
    timeout_s: float | None,
) -> grpc.aio.Channel:
    return create_channel(
        target,
        service,
        timeout_s=timeout_s or settings.rpc_timeout_s,
        idempotent_methods=IDEMPOTENT[service],
        tracer_provider=provider,
        max_message_bytes=settings.max_message_bytes,
    )


def admission(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
) -> Peer[admission_pb2_grpc.AdmissionServiceAsyncStub]:
    channel = _channel(target or settings.admission_addr, ADMISSION, settings, provider, timeout_s)
    return Peer(_async(admission_pb2_grpc.AdmissionServiceStub(channel)), channel)


def substrate(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
) -> Peer[substrate_pb2_grpc.SubstrateServiceAsyncStub]:
    channel = _channel(target or settings.substrate_addr, SUBSTRATE, settings, provider, timeout_s)
    return Peer(_async(substrate_pb2_grpc.SubstrateServiceStub(channel)), channel)


def affinity(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
) -> Peer[affinity_pb2_grpc.AffinityServiceAsyncStub]:
    channel = _channel(target or settings.affinity_addr, AFFINITY, settings, provider, timeout_s)
    return Peer(_async(affinity_pb2_grpc.AffinityServiceStub(channel)), channel)
