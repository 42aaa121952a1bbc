"""What every command gets: where the services are, a deadline, and an output.

Addresses come from, in order: ``--target`` (the one service a command talks
to), ``--admission``/``--substrate``/``--affinity``, the ``TURNSTILE_*_ADDR``
variables the services themselves read, and the description of the stack the
command targets (:mod:`turnstile_cli.target`: the one named by ``--stack``, or
this checkout's; never another checkout's unasked). Against a cluster,
port-forward the three services and point these at the forwards.

Each service must present the SPIFFE ID the CLI expects of it (SPEC O5):
``TURNSTILE_ADMISSION_SPIFFE_ID`` / ``_SUBSTRATE_`` / ``_AFFINITY_``, by default the
local stack's (``spiffe://turnstile.local/service/admission`` …); a server with
any other certificate fails the handshake.

The transport comes from ``--cert/--key/--ca`` and the ``TURNSTILE_TLS_*_FILE`` /
``TURNSTILE_PLAINTEXT`` variables first; what they leave unsaid comes from the
running local stack's description when the CLI talks to that stack's own
addresses (plaintext for a ``--plaintext`` stack, else its CLI certificate), and
last from ``.run/tls`` of the working directory.
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
    from turnstile_cli.target import Target
    from turnstile_client import TurnstileClient
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

SERVICES = ("admission", "substrate", "affinity")


@dataclass(frozen=True)
class LocalStack:
    """What the running local stack's ``stack.json`` says about reaching it."""

    path: Path
    addresses: dict[str, str]
    plaintext: bool
    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None
    server_ids: dict[str, str] = field(default_factory=dict)
    redis_url: str | None = None
    redis_prefix: str | None = None

    #: The runner's pid (it names the stack among the running ones).
    pid: int | None = None
    #: The checkout it belongs to (None: a state directory outside any ``.run/``).
    checkout: Path | None = None

    @classmethod
    def read(cls, path: Path) -> LocalStack | None:
        """The stack ``path`` describes, or None: no file, an unreadable one, or one
        whose runner is gone (a stack killed outright leaves its file behind, and
        its addresses and certificates then describe nothing)."""
        from turnstile_cli.stack import state

        data = state.read(path)
        if data is None:
            return None
        runner = state.recorded_runner(data)
        if runner is None:
            return None
        from turnstile_cli.stack import procs

        if not procs.alive(runner):
            return None
        return cls.of(path, data)

    @classmethod
    def of(cls, path: Path, data: dict[str, object]) -> LocalStack | None:
        """A description's reach (None: written by an older ``up``, no transport)."""
        from turnstile_cli.target import checkout_of

        def text(value: object) -> str | None:
            return value if isinstance(value, str) and value else None

        addresses = data.get("addresses")
        transport = data.get("transport")
        if not isinstance(addresses, dict) or not isinstance(transport, dict):
            return None  # written by an older ``up``: no transport recorded
        ids = transport.get("server_ids")

        def file(name: str) -> Path | None:
            value = text(transport.get(name))
            return Path(value) if value else None

        pid = data.get("pid")
        return cls(
            path=path,
            addresses={k: v for k, v in addresses.items() if isinstance(v, str)},
            plaintext=transport.get("mode") == "plaintext",
            cert=file("cert"),
            key=file("key"),
            ca=file("ca"),
            server_ids=(
                {k: v for k, v in ids.items() if isinstance(v, str)}
                if isinstance(ids, dict)
                else {}
            ),
            redis_url=text(data.get("redis_url")),
            redis_prefix=text(data.get("redis_prefix")),
            pid=pid if isinstance(pid, int) else None,
            checkout=checkout_of(path, data),
        )

    @property
    def mode(self) -> str:
        return "plaintext" if self.plaintext else "mutual TLS"


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
        cls,
        cert: str | None = None,
        key: str | None = None,
        ca: str | None = None,
        *,
        stack: LocalStack | None = None,
    ) -> ClientTls:
        """``stack``: the running local stack, when the CLI talks to its addresses."""
        env = os.environ

        def pick(
            flag: str | None, variable: str, local: str, described: Path | None
        ) -> Path | None:
            if flag:
                return Path(flag)
            if env.get(variable):
                return Path(env[variable])
            if described is not None:
                return described
            candidate = LOCAL_TLS_DIR / local
            return candidate if candidate.is_file() else None

        explicit = env.get("TURNSTILE_PLAINTEXT", "").strip()
        plaintext = explicit.lower() in _TRUE if explicit else stack is not None and stack.plaintext
        return cls(
            cert=pick(cert, "TURNSTILE_TLS_CERT_FILE", "cli.crt", stack.cert if stack else None),
            key=pick(key, "TURNSTILE_TLS_KEY_FILE", "cli.key", stack.key if stack else None),
            ca=pick(ca, "TURNSTILE_TLS_CA_FILE", "ca.crt", stack.ca if stack else None),
            plaintext=plaintext,
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
        *,
        stack: LocalStack | None = None,
    ) -> Targets:
        env = os.environ
        where = stack.addresses if stack is not None else {}
        ids = stack.server_ids if stack is not None else {}
        return cls(
            admission=admission
            or env.get("TURNSTILE_ADMISSION_ADDR")
            or where.get("admission", LOCAL_ADMISSION),
            substrate=substrate
            or env.get("TURNSTILE_SUBSTRATE_ADDR")
            or where.get("substrate", LOCAL_SUBSTRATE),
            affinity=affinity
            or env.get("TURNSTILE_AFFINITY_ADDR")
            or where.get("affinity", LOCAL_AFFINITY),
            admission_id=env.get("TURNSTILE_ADMISSION_SPIFFE_ID")
            or ids.get("admission", LOCAL_ADMISSION_ID),
            substrate_id=env.get("TURNSTILE_SUBSTRATE_SPIFFE_ID")
            or ids.get("substrate", LOCAL_SUBSTRATE_ID),
            affinity_id=env.get("TURNSTILE_AFFINITY_SPIFFE_ID")
            or ids.get("affinity", LOCAL_AFFINITY_ID),
        )

    def reach(self, stack: LocalStack | None) -> bool:
        """Whether these targets are the local stack's side of the machine: every
        address loopback (the stack's own, or one a flag names there), so the
        stack's transport applies; a remote target needs its own settings."""
        if stack is None:
            return False
        return all(_loopback(getattr(self, name)) for name in SERVICES)


def _checkout_prefix() -> str | None:
    """The prefix ``turnstilectl up`` gives the checkout this command runs in, for
    a change made while its stack is down: ``keys allow --redis-prefix …`` before
    ``./scripts/up`` lands where that stack reads."""
    from turnstile_cli.stack.config import checkout_prefix
    from turnstile_cli.target import checkout_here

    found = checkout_here()
    return checkout_prefix(found[0] / ".run" / "direct") if found is not None else None


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]") if ":" in address else address
    return host in ("localhost", "::1") or host.startswith("127.")


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
    #: The running stack the command targets, if any (its ``stack.json`` names it).
    stack: LocalStack | None = None
    #: What the command acts on and how it was chosen (None: a command of no stack).
    target: Target | None = None
    #: Whether calls record client spans: only when they are exported somewhere;
    #: otherwise each call only carries the command's trace context (the servers'
    #: spans still join it), which spares every command the instrumentation's import.
    client_spans: bool = False

    def redis_target(self, url: str | None, prefix: str | None) -> tuple[str, str]:
        """The Redis URL and key prefix of ``keys``, ``limits`` and ``demo``: the
        flag, else ``TURNSTILE_REDIS_URL`` / ``_PREFIX``, else the target stack's
        (:mod:`turnstile_cli.target`), else (the prefix) the one ``up`` gives this
        checkout, else the services' defaults."""
        from turnstile_platform.settings import ServiceSettings

        defaults = ServiceSettings()
        env = os.environ
        described = self.stack
        if not url:
            if env.get("TURNSTILE_REDIS_URL") or described is None or not described.redis_url:
                url = str(defaults.redis_url)
            else:
                url = described.redis_url
        if not prefix:
            if env.get("TURNSTILE_REDIS_PREFIX"):
                prefix = defaults.redis_prefix
            elif described is not None and described.redis_prefix:
                prefix = described.redis_prefix
            else:
                prefix = _checkout_prefix() or defaults.redis_prefix
        return url, prefix

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
    async def client(self, *services: str) -> AsyncIterator[TurnstileClient]:
        """The typed client (:mod:`turnstile_client`, what docs/clients.md offers
        callers) on this CLI's channels to ``services``: their transport, deadline
        and trace come from here; its calls give refusals and errors one shape
        (:class:`turnstile_client.TurnstileError`). It does not retry: a person
        sees the retry hint and decides (exit 4)."""
        from turnstile_client import Retry, TurnstileClient
        from turnstile_platform import peers

        opened = {
            name: getattr(peers, name)(
                self.settings(), self.tracer_provider, client_spans=self.client_spans
            )
            for name in services
        }
        channels = {name: peer.channel for name, peer in opened.items()}
        try:
            yield TurnstileClient(
                admission=channels.get("admission"),
                substrate=channels.get("substrate"),
                affinity=channels.get("affinity"),
                deadline_s=self.timeout_s,
                retry=Retry(attempts=1),
            )
        finally:
            for peer in opened.values():
                await peer.close()

    @asynccontextmanager
    async def admission(self) -> AsyncIterator[admission_pb2_grpc.AdmissionServiceAsyncStub]:
        from turnstile_platform import peers

        peer = peers.admission(
            self.settings(), self.tracer_provider, client_spans=self.client_spans
        )
        try:
            # A stub on a grpc.aio channel is the async stub.
            yield peer.stub
        finally:
            await peer.close()

    @asynccontextmanager
    async def admin(self) -> AsyncIterator[admission_pb2_grpc.AdminServiceAsyncStub]:
        """Admission's admin API (limits, the key set: SPEC M1), called with this
        CLI's certificate: only an operator's is allowed."""
        from turnstile_platform import peers

        peer = peers.admin(self.settings(), self.tracer_provider, client_spans=self.client_spans)
        try:
            yield peer.stub
        finally:
            await peer.close()

    @asynccontextmanager
    async def substrate(self) -> AsyncIterator[substrate_pb2_grpc.SubstrateServiceAsyncStub]:
        from turnstile_platform import peers

        peer = peers.substrate(
            self.settings(), self.tracer_provider, client_spans=self.client_spans
        )
        try:
            yield peer.stub
        finally:
            await peer.close()

    @asynccontextmanager
    async def affinity(self) -> AsyncIterator[affinity_pb2_grpc.AffinityServiceAsyncStub]:
        from turnstile_platform import peers

        peer = peers.affinity(self.settings(), self.tracer_provider, client_spans=self.client_spans)
        try:
            yield peer.stub
        finally:
            await peer.close()
