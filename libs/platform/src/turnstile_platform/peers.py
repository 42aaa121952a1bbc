"""Typed stubs for calling the other Turnstile services.

Which methods are idempotent (safe for gRPC to retry on UNAVAILABLE) is declared
here, once, next to the service they belong to. Admit and Activate are not
retried by the channel: a retry after a lost response could take a second hold
or create a second runtime; their callers decide.

Channels use mTLS with the process's own certificate (SPEC Z1), and check that
the server holds the SPIFFE ID the settings expect of that service (SPEC O5;
:mod:`turnstile_platform.tls`): a valid-CA certificate of anyone else fails the
handshake (UNAVAILABLE, "Hostname Verification Check failed"). grpc reads a
channel's client certificate once, so a :class:`Peer` checks the files'
signatures at most every :data:`ROTATION_CHECK_S` and, when they changed, builds
a new channel for the calls that follow; the old one is closed after
:data:`RETIRE_AFTER_S`, so calls in flight on it finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
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
from turnstile_platform import tls
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.channels import create_channel

ADMISSION = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
#: Admission's admin API (SPEC M1), on admission's address.
ADMIN = admission_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
SUBSTRATE = substrate_pb2.DESCRIPTOR.services_by_name["SubstrateService"].full_name
AFFINITY = affinity_pb2.DESCRIPTOR.services_by_name["AffinityService"].full_name

IDEMPOTENT = {
    ADMISSION: ("CommitHold", "CancelHold", "ReleaseSandbox", "GetUsage"),
    ADMIN: ("GetLimits", "GetKeySet"),
    SUBSTRATE: ("Deactivate", "CountLiveSandboxes", "GetSandbox", "ListSandboxes"),
    AFFINITY: ("ReleaseLease", "GetSession", "ListWorkers", "Prepare"),
}


StubT = TypeVar("StubT")


class PeerSettings(tls.TransportSettings, Protocol):
    """What a peer channel reads from settings (addresses, deadline, message size,
    and the transport security fields). ``ServiceSettings`` has all of it;
    ``turnstilectl`` passes a plain object, so a command does not import pydantic."""

    @property
    def admission_addr(self) -> str: ...
    @property
    def substrate_addr(self) -> str: ...
    @property
    def affinity_addr(self) -> str: ...
    @property
    def admission_spiffe_id(self) -> str: ...
    @property
    def substrate_spiffe_id(self) -> str: ...
    @property
    def affinity_spiffe_id(self) -> str: ...
    @property
    def rpc_timeout_s(self) -> float: ...
    @property
    def max_message_bytes(self) -> int: ...


ROTATION_CHECK_S = 5.0
RETIRE_AFTER_S = 60.0


class _RotatingStub:
    """Delegates to the peer's current stub, rebuilding it after a certificate change."""

    def __init__(self, peer: Peer[Any]) -> None:
        self._peer = peer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer.current_stub(), name)


class Peer(Generic[StubT]):
    """A stub and the channel it owns; close the channel when done.

    ``stub`` stays valid across certificate rotations (it follows the current
    channel), so callers may keep it."""

    def __init__(
        self,
        make_stub: Callable[[grpc.aio.Channel], StubT],
        make_channel: Callable[[grpc.ChannelCredentials | None], grpc.aio.Channel],
        source: tls.ChannelCredentialsSource | None,
        reload_source: Callable[[], tls.ChannelCredentialsSource] | None = None,
    ) -> None:
        self._make_stub = make_stub
        self._make_channel = make_channel
        self._source = source
        self._reload_source = reload_source
        self.channel = make_channel(source.credentials if source else None)
        self._stub = make_stub(self.channel)
        self._checked_at = time.monotonic()
        # On every replica: each closes its own retired channels once their calls end.
        self._retired = BackgroundTasks("peer channel retirement")
        self.stub: StubT = (
            _RotatingStub(self) if source is not None else self._stub  # type: ignore[assignment]  # a proxy with StubT's methods
        )

    def current_stub(self) -> StubT:
        now = time.monotonic()
        if self._source is not None and now - self._checked_at >= ROTATION_CHECK_S:
            self._checked_at = now
            if self._source.changed():
                self._rotate()
        return self._stub

    def _rotate(self) -> None:
        assert self._reload_source is not None
        try:
            source = self._reload_source()
        except (OSError, ValueError):
            return  # half-written files: keep the old channel, look again later
        old = self.channel
        self._source = source
        self.channel = self._make_channel(source.credentials)
        self._stub = self._make_stub(self.channel)
        self._retired.spawn(self._retire(old), name="retire a rotated peer channel")

    @staticmethod
    async def _retire(channel: grpc.aio.Channel) -> None:
        await asyncio.sleep(RETIRE_AFTER_S)
        await channel.close(grace=None)

    async def close(self) -> None:
        await self._retired.close()
        await self.channel.close(grace=None)


def _async(stub: Any) -> Any:
    """A stub built on a grpc.aio channel is the async stub of mypy-protobuf's types
    (its methods return awaitables); the generated constructor cannot say so."""
    return stub


def _peer(
    make_stub: Callable[[grpc.aio.Channel], Any],
    target: str,
    service: str,
    settings: PeerSettings,
    provider: trace.TracerProvider | None,
    timeout_s: float | None,
    server_id: str,
    client_spans: bool = True,
) -> Peer[Any]:
    def make_channel(credentials: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        return create_channel(
            target,
            service,
            timeout_s=timeout_s or settings.rpc_timeout_s,
            idempotent_methods=IDEMPOTENT[service],
            tracer_provider=provider,
            max_message_bytes=settings.max_message_bytes,
            credentials=credentials,
            server_id=server_id,
            client_spans=client_spans,
        )

    def reload() -> tls.ChannelCredentialsSource:
        source = tls.client_source(settings, target, service, server_id=server_id)
        assert source is not None
        return source

    source = tls.client_source(settings, target, service, server_id=server_id)
    return Peer(lambda channel: _async(make_stub(channel)), make_channel, source, reload)


def admission(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
    server_id: str | None = None,
    client_spans: bool = True,
) -> Peer[admission_pb2_grpc.AdmissionServiceAsyncStub]:
    """A peer of the admission service at ``target`` (default: the settings' address),
    whose certificate must hold ``server_id`` (default: ``admission_spiffe_id``)."""
    return _peer(
        admission_pb2_grpc.AdmissionServiceStub,
        target or settings.admission_addr,
        ADMISSION,
        settings,
        provider,
        timeout_s,
        server_id or settings.admission_spiffe_id,
        client_spans,
    )


def admin(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
    client_spans: bool = True,
) -> Peer[admission_pb2_grpc.AdminServiceAsyncStub]:
    """A peer of admission's admin API (SPEC M1) at ``target`` (default: admission's
    address), whose certificate must hold ``admission_spiffe_id``."""
    return _peer(
        admission_pb2_grpc.AdminServiceStub,
        target or settings.admission_addr,
        ADMIN,
        settings,
        provider,
        timeout_s,
        settings.admission_spiffe_id,
        client_spans,
    )


def substrate(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
    server_id: str | None = None,
    client_spans: bool = True,
) -> Peer[substrate_pb2_grpc.SubstrateServiceAsyncStub]:
    """A peer of the substrate service at ``target`` (default: the settings' address),
    whose certificate must hold ``server_id`` (default: ``substrate_spiffe_id``)."""
    return _peer(
        substrate_pb2_grpc.SubstrateServiceStub,
        target or settings.substrate_addr,
        SUBSTRATE,
        settings,
        provider,
        timeout_s,
        server_id or settings.substrate_spiffe_id,
        client_spans,
    )


def affinity(
    settings: PeerSettings,
    provider: trace.TracerProvider | None = None,
    *,
    target: str | None = None,
    timeout_s: float | None = None,
    server_id: str | None = None,
    client_spans: bool = True,
) -> Peer[affinity_pb2_grpc.AffinityServiceAsyncStub]:
    """A peer of the affinity service at ``target`` (default: the settings' address),
    whose certificate must hold ``server_id`` (default: ``affinity_spiffe_id``)."""
    return _peer(
        affinity_pb2_grpc.AffinityServiceStub,
        target or settings.affinity_addr,
        AFFINITY,
        settings,
        provider,
        timeout_s,
        server_id or settings.affinity_spiffe_id,
        client_spans,
    )
