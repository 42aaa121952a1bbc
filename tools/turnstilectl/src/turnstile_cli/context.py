"""What every command gets: where the services are, a deadline, and an output.

Addresses come from, in order: ``--target`` (the one service a command talks
to), ``--admission``/``--substrate``/``--affinity``, the ``TURNSTILE_*_ADDR``
variables the services themselves read, and the local stack's ports. Against a
cluster, port-forward the three services and point these at the forwards.

Each service must present the SPIFFE ID the CLI expects of it (SPEC O5):
``TURNSTILE_ADMISSION_SPIFFE_ID`` / ``_SUBSTRATE_`` / ``_AFFINITY_``, by default the
local stack's (``spiffe://turnstile.local/service/admission`` …); a server with
any other certificate fails the handshake.

The mTLS client certificate comes from ``--cert/--key/--ca``, then the
``TURNSTILE_TLS_*_FILE`` variables, then the local stack's CLI certificate in
``.run/tls`` (which ``./scripts/up`` issues on first start). With
``TURNSTILE_PLAINTEXT=true`` and loopback targets, no certificate is needed.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a command imports the contracts and channels it uses, when it uses them
    import grpc
    from opentelemetry import trace

    from turnstile_cli.output import Output
    from turnstile_contracts import admission_pb2_grpc, affinity_pb2_grpc, substrate_pb2_grpc

#: Where the local stack (``turnstilectl up``) listens.
LOCAL_ADMISSION = "127.0.0.1:50051"
LOCAL_SUBSTRATE = "127.0.0.1:50052"
LOCAL_AFFINITY = "127.0.0.1:50053"

DEFAULT_TIMEOUT_S = 10.0

#: Who the local stack's services are (``turnstilectl up`` issues their certificates).
LOCAL_ADMISSION_ID = "spiffe://turnstile.local/service/admission"
LOCAL_SUBSTRATE_ID = "spiffe://turnstile.local/service/substrate"
LOCAL_AFFINITY_ID = "spiffe://turnstile.local/service/affinity"

#: Where ``turnstilectl up`` writes the local CA and certificates.
LOCAL_TLS_DIR = Path(".run/tls")

_TRUE = frozenset({"1", "true", "yes", "on"})


@dataclass(frozen=True)
class ClientTls:
    """The CLI's certificate, key and CA bundle (None: not found; a channel then
    refuses to build unless plaintext is enabled)."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    plaintext: bool = False

    @classmethod
    def resolve(
        cls, cert: str | None = None, key: str | None = None, ca: str | None = None
    ) -> ClientTls:
        env = os.environ

        def pick(flag: str | None, variable: str, local: str) -> Path | None:
            if flag:
                return Path(flag)
            if env.get(variable):
                return Path(env[variable])
            candidate = LOCAL_TLS_DIR / local
            return candidate if candidate.is_file() else None

        return cls(
            cert=pick(cert, "TURNSTILE_TLS_CERT_FILE", "cli.crt"),
            key=pick(key, "TURNSTILE_TLS_KEY_FILE", "cli.key"),
            ca=pick(ca, "TURNSTILE_TLS_CA_FILE", "ca.crt"),
            plaintext=env.get("TURNSTILE_PLAINTEXT", "").strip().lower() in _TRUE,
        )


@dataclass(frozen=True)
class Targets:
    admission: str = LOCAL_ADMISSION
    substrate: str = LOCAL_SUBSTRATE
    affinity: str = LOCAL_AFFINITY
    admission_id: str = LOCAL_ADMISSION_ID
    substrate_id: str = LOCAL_SUBSTRATE_ID
    affinity_id: str = LOCAL_AFFINITY_ID

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
            admission_id=env.get("TURNSTILE_ADMISSION_SPIFFE_ID") or LOCAL_ADMISSION_ID,
            substrate_id=env.get("TURNSTILE_SUBSTRATE_SPIFFE_ID") or LOCAL_SUBSTRATE_ID,
            affinity_id=env.get("TURNSTILE_AFFINITY_SPIFFE_ID") or LOCAL_AFFINITY_ID,
        )


@dataclass(frozen=True)
class PeerSettings:
    """:class:`turnstile_platform.peers.PeerSettings` without pydantic's import cost."""

    admission_addr: str
    substrate_addr: str
    affinity_addr: str
    rpc_timeout_s: float
    admission_spiffe_id: str = LOCAL_ADMISSION_ID
    substrate_spiffe_id: str = LOCAL_SUBSTRATE_ID
    affinity_spiffe_id: str = LOCAL_AFFINITY_ID
    max_message_bytes: int = 4 * 1024 * 1024
    plaintext: bool = False
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None


@dataclass
class Context:
    out: Output
    targets: Targets = field(default_factory=Targets)
    timeout_s: float = DEFAULT_TIMEOUT_S
    tracer_provider: trace.TracerProvider | None = None
    tls: ClientTls = field(default_factory=ClientTls)

    def settings(self) -> PeerSettings:
        """Channel settings for :mod:`turnstile_platform.peers` (deadline, addresses).

        Every channel the CLI opens is made here, through ``peers``: connection
        options (credentials, message sizes) belong in this one place."""
        return PeerSettings(
            admission_addr=self.targets.admission,
            substrate_addr=self.targets.substrate,
            affinity_addr=self.targets.affinity,
            rpc_timeout_s=self.timeout_s,
            admission_spiffe_id=self.targets.admission_id,
            substrate_spiffe_id=self.targets.substrate_id,
            affinity_spiffe_id=self.targets.affinity_id,
            plaintext=self.tls.plaintext,
            tls_cert_file=self.tls.cert,
            tls_key_file=self.tls.key,
            tls_ca_file=self.tls.ca,
        )

    def credentials(
        self, target: str, server_id: str
    ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
        """mTLS credentials for a raw channel to ``target`` and the channel
        arguments that check its server is ``server_id`` (None and no arguments:
        plaintext)."""
        from turnstile_platform import tls

        source = tls.client_source(self.settings(), target, "turnstilectl", server_id=server_id)
        return (source.credentials, source.options) if source is not None else (None, [])

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
