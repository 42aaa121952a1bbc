"""A small typed async client for Turnstile's three services.

What every caller would otherwise write by hand:

* **mTLS and the server's identity** (SPEC Z1, O5): a channel presents the caller's
  certificate and checks the server's. Each service certificate carries, beside
  its SPIFFE ID, the DNS name derived from it (``spiffe://turnstile.local/service/
  admission`` → ``admission.service.turnstile.local``), and gRPC's hostname check
  reads DNS names only, so each channel sets ``grpc.ssl_target_name_override`` to
  that name: a server with a valid certificate for another identity fails the
  handshake.
* **Deadlines**: every call has one (``deadline_s``, overridable per call).
* **Retries driven by ``RetryInfo``**: an ``UNAVAILABLE`` error that carries a
  retry hint (a dependency down, a replica overloaded: nothing was decided) is
  retried after the hinted delay, a bounded number of times and never past the
  call's deadline. Anything else is raised at once.
* **One shape for refusals**: a refused ``Admit`` (an OK response) and a refused
  ``Activate`` (a ``RESOURCE_EXHAUSTED`` error) both raise
  :class:`~turnstile_client.errors.Refused`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import grpc.aio

from turnstile_client.errors import TurnstileError, decode, refused_admit
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)

T = TypeVar("T")

#: The trust domain of the local stack's PKI (``turnstilectl up``).
DEFAULT_TRUST_DOMAIN = "turnstile.local"


def server_name(spiffe_id: str) -> str:
    """The DNS name a Turnstile server holding ``spiffe_id`` carries: the path
    segments reversed, then the trust domain."""
    rest = spiffe_id.removeprefix("spiffe://")
    if rest == spiffe_id or "/" not in rest:
        raise ValueError(f"{spiffe_id!r} is not a SPIFFE ID with a path")
    domain, path = rest.split("/", 1)
    return ".".join([*reversed(path.split("/")), domain])


@dataclass(frozen=True)
class Tls:
    """The caller's certificate chain and key and the CA bundle it trusts (PEM files)."""

    cert: Path
    key: Path
    ca: Path

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes(),
            certificate_chain=self.cert.read_bytes(),
        )


@dataclass(frozen=True)
class Retry:
    """How ``UNAVAILABLE`` errors with a ``RetryInfo`` hint are retried: at most
    ``attempts`` calls in all, each wait the server's hint capped at ``max_delay_s``."""

    attempts: int = 3
    max_delay_s: float = 2.0


def _channel(
    target: str, tls: Tls | None, spiffe_id: str | None, credentials: grpc.ChannelCredentials | None
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(target)
    options = [("grpc.ssl_target_name_override", server_name(spiffe_id))] if spiffe_id else []
    assert credentials is not None
    return grpc.aio.secure_channel(target, credentials, options=options)


class TurnstileClient:
    """Channels to admission, substrate and affinity; ``async with`` closes them."""

    def __init__(
        self,
        *,
        admission: grpc.aio.Channel | None,
        substrate: grpc.aio.Channel | None,
        affinity: grpc.aio.Channel | None,
        deadline_s: float,
        retry: Retry,
    ) -> None:
        self._channels = [c for c in (admission, substrate, affinity) if c is not None]
        self._admission = admission_pb2_grpc.AdmissionServiceStub(admission) if admission else None
        self._substrate = substrate_pb2_grpc.SubstrateServiceStub(substrate) if substrate else None
        self._affinity = affinity_pb2_grpc.AffinityServiceStub(affinity) if affinity else None
        self.deadline_s = deadline_s
        self.retry = retry

    @classmethod
    def connect(
        cls,
        *,
        admission: str | None = None,
        substrate: str | None = None,
        affinity: str | None = None,
        tls: Tls | None,
        trust_domain: str = DEFAULT_TRUST_DOMAIN,
        server_ids: dict[str, str] | None = None,
        deadline_s: float = 10.0,
        retry: Retry = Retry(),
    ) -> TurnstileClient:
        """Channels to the services given by address (``host:port``). ``tls=None`` is
        plaintext, which the services accept only on loopback when started so.
        ``server_ids`` overrides the SPIFFE ID expected of a service (by its name,
        ``admission``…); the default is ``spiffe://<trust_domain>/service/<name>``."""
        credentials = tls.credentials() if tls is not None else None
        ids = {
            name: f"spiffe://{trust_domain}/service/{name}"
            for name in ("admission", "substrate", "affinity")
        } | (server_ids or {})

        def open_(name: str, target: str | None) -> grpc.aio.Channel | None:
            return _channel(target, tls, ids[name], credentials) if target else None

        return cls(
            admission=open_("admission", admission),
            substrate=open_("substrate", substrate),
            affinity=open_("affinity", affinity),
            deadline_s=deadline_s,
            retry=retry,
        )

    async def close(self) -> None:
        await asyncio.gather(*(c.close(None) for c in self._channels))

    async def __aenter__(self) -> TurnstileClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def admit(
        self,
        sandbox_id: str,
        client_id: str,
        *,
        tier: str = "",
        kind: common_pb2.ActivationKind.ValueType = common_pb2.ACTIVATION_KIND_COLD_CREATE,
        deadline_s: float | None = None,
    ) -> admission_pb2.AdmitResponse:
        """Admit an activation; the response holds the hold to commit or cancel.
        Raises :class:`Refused` when a limit refused it."""
        stub = _need(self._admission, "admission")
        request = admission_pb2.AdmitRequest(
            sandbox_id=sandbox_id,
            client=common_pb2.ActivationClient(client_id=client_id),
            kind=kind,
            tier=tier,
        )
        response: admission_pb2.AdmitResponse = await self._call(
            lambda t: stub.Admit(request, timeout=t), deadline_s
        )
        if response.decision == admission_pb2.DECISION_REFUSED:
            raise refused_admit(response)
        return response

    async def activate(
        self,
        sandbox_id: str,
        client: str | common_pb2.ActivationClient,
        *,
        tier: str = "",
        dry_run: bool = False,
        deadline_s: float | None = None,
        wait_s: float = 0.0,
        queue_per_client: bool = False,
        wait_id: str = "",
    ) -> substrate_pb2.ActivateResponse:
        """Make the sandbox's runtime exist, charged to ``client``: a client id, or
        any form of ``ActivationClient`` (``inherit``, ``native``, ``unattributed``).
        ``dry_run``: decide and report without changing anything.
        Raises :class:`Refused` when a limit refused it, :class:`TurnstileError` for
        any other error.

        ``wait_s`` > 0: wait up to that long in admission's fair queue when only a
        shared resource refuses (the default deadline grows by it), or with
        ``queue_per_client`` when only the client's own limits do; ``wait_id``
        (your id of this call, fresh per call) lets admission's GetQueuePosition
        say where it stands while it waits."""
        stub = _need(self._substrate, "substrate")
        request = substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id,
            client=(
                common_pb2.ActivationClient(client_id=client) if isinstance(client, str) else client
            ),
            tier=tier,
            dry_run=dry_run,
        )
        if wait_s > 0:
            request.wait_budget.FromMilliseconds(round(wait_s * 1000))
            request.queue_per_client = queue_per_client
            request.wait_id = wait_id
            if deadline_s is None:
                deadline_s = self.deadline_s + wait_s
        response: substrate_pb2.ActivateResponse = await self._call(
            lambda t: stub.Activate(request, timeout=t), deadline_s
        )
        return response

    async def place(
        self, session_id: str, client_id: str, *, tier: str = "", deadline_s: float | None = None
    ) -> affinity_pb2.PlaceResponse:
        """Place a session on a worker (the one it had, when it can)."""
        stub = _need(self._affinity, "affinity")
        request = affinity_pb2.PlaceRequest(session_id=session_id, tier=tier, client_id=client_id)
        response: affinity_pb2.PlaceResponse = await self._call(
            lambda t: stub.Place(request, timeout=t), deadline_s
        )
        return response

    async def prepare(
        self, session_id: str, client_id: str, *, deadline_s: float | None = None
    ) -> affinity_pb2.PrepareResponse:
        """Say the session is about to take a turn (the user opened it or started typing):
        its sandbox's wake starts now if it is away (SPEC W2). Returns at once with what
        was done (``outcome``); takes no lease. Call it without waiting on it."""
        stub = _need(self._affinity, "affinity")
        request = affinity_pb2.PrepareRequest(session_id=session_id, client_id=client_id)
        response: affinity_pb2.PrepareResponse = await self._call(
            lambda t: stub.Prepare(request, timeout=t), deadline_s
        )
        return response

    async def _call(self, call: Callable[[float], Awaitable[T]], deadline_s: float | None) -> T:
        """``call`` with what is left of the deadline, retried while the server
        says ``UNAVAILABLE`` with a retry hint and both attempts and time remain."""
        deadline = time.monotonic() + (deadline_s if deadline_s is not None else self.deadline_s)
        attempt = 0
        while True:
            attempt += 1
            left = deadline - time.monotonic()
            try:
                return await call(max(left, 0.001))
            except grpc.RpcError as exc:
                error = decode(exc)
                if not _should_retry(error, attempt, self.retry, deadline):
                    raise error from None
                assert error.retry_after_s is not None
                await asyncio.sleep(min(error.retry_after_s, self.retry.max_delay_s))


def _should_retry(error: TurnstileError, attempt: int, retry: Retry, deadline: float) -> bool:
    if error.code != grpc.StatusCode.UNAVAILABLE or error.retry_after_s is None:
        return False
    wait = min(error.retry_after_s, retry.max_delay_s)
    return attempt < retry.attempts and time.monotonic() + wait < deadline


def _need(stub: T | None, service: str) -> T:
    if stub is None:
        raise ValueError(f"this client has no {service} address: pass {service}= to connect()")
    return stub
