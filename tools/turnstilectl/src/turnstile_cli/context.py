"""What every command gets: where the services are, a deadline, and an output.

Addresses come from, in order: ``--target`` (the one service a command talks
to), ``--admission``/``--substrate``/``--affinity``, the ``TURNSTILE_*_ADDR``
variables the services themselves read, and the local stack's ports. Against a
cluster, port-forward the three services and point these at the forwards.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a command imports the contracts and channels it uses, when it uses them
    from opentelemetry import trace

    from turnstile_cli.output import Output
    from turnstile_contracts import admission_pb2_grpc, affinity_pb2_grpc, substrate_pb2_grpc

#: Where the local stack (``turnstilectl up``) listens.
LOCAL_ADMISSION = "127.0.0.1:50051"
LOCAL_SUBSTRATE = "127.0.0.1:50052"
LOCAL_AFFINITY = "127.0.0.1:50053"

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Targets:
    admission: str = LOCAL_ADMISSION
    substrate: str = LOCAL_SUBSTRATE
    affinity: str = LOCAL_AFFINITY

    @classmethod
    def resolve(
        cls,
        admission: str | None = None,
        substrate: str | None = None,
        affinity: str | None = None,
    ) -> Targets:
        env = os.environ
        return cls(
            admission=admission or env.get("TURNSTILE_ADMISSION_ADDR") or LOCAL_ADMISSION,
            substrate=substrate or env.get("TURNSTILE_SUBSTRATE_ADDR") or LOCAL_SUBSTRATE,
            affinity=affinity or env.get("TURNSTILE_AFFINITY_ADDR") or LOCAL_AFFINITY,
        )


@dataclass(frozen=True)
class PeerSettings:
    """:class:`turnstile_platform.peers.PeerSettings` without pydantic's import cost."""

    admission_addr: str
    substrate_addr: str
    affinity_addr: str
    rpc_timeout_s: float
    max_message_bytes: int = 4 * 1024 * 1024


@dataclass
class Context:
    out: Output
    targets: Targets = field(default_factory=Targets)
    timeout_s: float = DEFAULT_TIMEOUT_S
    tracer_provider: trace.TracerProvider | None = None

    def settings(self) -> PeerSettings:
        """Channel settings for :mod:`turnstile_platform.peers` (deadline, addresses).

        Every channel the CLI opens is made here, through ``peers``: connection
        options (credentials, message sizes) belong in this one place."""
        return PeerSettings(
            admission_addr=self.targets.admission,
            substrate_addr=self.targets.substrate,
            affinity_addr=self.targets.affinity,
            rpc_timeout_s=self.timeout_s,
        )

    @asynccontextmanager
    async def admission(self) -> AsyncIterator[admission_pb2_grpc.AdmissionServiceAsyncStub]:
        from turnstile_platform import peers

        peer = peers.admission(self.settings(), self.tracer_provider)
        try:
            # A stub on a grpc.aio channel is the async stub.
            yield peer.stub
        finally:
            await peer.close()

    @asynccontextmanager
    async def substrate(self) -> AsyncIterator[substrate_pb2_grpc.SubstrateServiceAsyncStub]:
        from turnstile_platform import peers

        peer = peers.substrate(self.settings(), self.tracer_provider)
        try:
            yield peer.stub
        finally:
            await peer.close()

    @asynccontextmanager
    async def affinity(self) -> AsyncIterator[affinity_pb2_grpc.AffinityServiceAsyncStub]:
        from turnstile_platform import peers

        peer = peers.affinity(self.settings(), self.tracer_provider)
        try:
            yield peer.stub
        finally:
            await peer.close()
