"""The AffinityService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
import grpc.aio
from google.protobuf import duration_pb2, timestamp_pb2
from opentelemetry import trace

from turnstile_affinity import validation
from turnstile_affinity.attestation import Attestation, refusal
from turnstile_affinity.decisions import logged_place
from turnstile_affinity.placement import (
    Placement,
    PlacementOutcome,
    Placer,
    Preparation,
    PrepareOutcome,
    Reset,
    ResetReason,
)
from turnstile_affinity.relay import (
    Attachment,
    IdleStreamError,
    PresenceTakenError,
    Relay,
    StreamEnd,
    StreamWatch,
    SupersededError,
    stream_max_age_s,
)
from turnstile_affinity.store import AffinityStore, SessionRecord
from turnstile_affinity.stream_limits import AttachLimits, AttachStream
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc, common_pb2
from turnstile_platform.authz.ownership import current_identity
from turnstile_platform.decision_log import DecisionLogWriter
from turnstile_platform.errors import RichError, bad_field, reason_name
from turnstile_platform.sandbox_credentials import CredentialRefusedError
from turnstile_platform.tiers import TierConfig

Context = grpc.aio.ServicerContext[Any, Any]

_OUTCOMES = {
    PlacementOutcome.HIT: affinity_pb2.PLACEMENT_OUTCOME_HIT,
    PlacementOutcome.FIRST: affinity_pb2.PLACEMENT_OUTCOME_FIRST,
    PlacementOutcome.FALLBACK: affinity_pb2.PLACEMENT_OUTCOME_FALLBACK,
}
_REASONS = {
    ResetReason.GRACE_EXPIRED: affinity_pb2.RESET_REASON_GRACE_EXPIRED,
    ResetReason.RETIERED: affinity_pb2.RESET_REASON_RETIERED,
    ResetReason.NOT_OWNED: affinity_pb2.RESET_REASON_NOT_OWNED,
}

_PREPARED = {
    PrepareOutcome.RUNNING: affinity_pb2.PREPARE_OUTCOME_RUNNING,
    PrepareOutcome.WAKE_STARTED: affinity_pb2.PREPARE_OUTCOME_WAKE_STARTED,
    PrepareOutcome.ALREADY_WAKING: affinity_pb2.PREPARE_OUTCOME_ALREADY_WAKING,
    PrepareOutcome.NO_SESSION: affinity_pb2.PREPARE_OUTCOME_NO_SESSION,
    PrepareOutcome.WILL_MOVE: affinity_pb2.PREPARE_OUTCOME_WILL_MOVE,
    PrepareOutcome.NOT_WOKEN: affinity_pb2.PREPARE_OUTCOME_NOT_WOKEN,
}


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def _duration(ms: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def _reset(reset: Reset) -> affinity_pb2.WorkspaceReset:
    return affinity_pb2.WorkspaceReset(
        from_sandbox_id=reset.from_sandbox_id,
        to_sandbox_id=reset.to_sandbox_id,
        at=_timestamp(reset.at_ms),
        reason=_REASONS[reset.reason],
    )


# ReleaseLease has two answers, built once: gRPC only serializes what a handler
# returns, and nothing here changes them after (a message built per call cost
# 0.23 µs more, docs/performance.md).
_RELEASED = affinity_pb2.ReleaseLeaseResponse(released=True)
_NOT_RELEASED = affinity_pb2.ReleaseLeaseResponse(released=False)


def _placement(placement: Placement) -> affinity_pb2.PlaceResponse:
    """The response, its lease expiry filled in place rather than built as a
    ``Timestamp`` and copied in (one message fewer per Place)."""
    response = affinity_pb2.PlaceResponse(
        sandbox_id=placement.sandbox_id,
        tier=placement.tier,
        lease_id=placement.lease_id,
        outcome=_OUTCOMES[placement.outcome],
        endpoint=placement.endpoint,
    )
    ms = placement.lease_expires_ms
    expires = response.lease_expires_at
    expires.seconds = ms // 1000
    expires.nanos = (ms % 1000) * 1_000_000
    if placement.reset is not None:
        response.reset.CopyFrom(_reset(placement.reset))
    return response


def _prepared(preparation: Preparation) -> affinity_pb2.PrepareResponse:
    response = affinity_pb2.PrepareResponse(
        outcome=_PREPARED[preparation.outcome], sandbox_id=preparation.sandbox_id
    )
    if preparation.remaining_grace_ms > 0:
        response.remaining_grace.CopyFrom(_duration(preparation.remaining_grace_ms))
    return response


def _session(session_id: str, record: SessionRecord) -> affinity_pb2.GetSessionResponse:
    response = affinity_pb2.GetSessionResponse(
        session_id=session_id,
        sandbox_id=record.sandbox_id,
        tier=record.tier,
        expires_at=_timestamp(record.expires_ms),
        client_id=record.client,
    )
    if record.reset_from and record.reset_to and record.reset_at_ms is not None:
        reason = ResetReason(record.reset_reason or ResetReason.GRACE_EXPIRED.value)
        response.last_reset.CopyFrom(
            _reset(Reset(record.reset_from, record.reset_to, record.reset_at_ms, reason))
        )
    return response


class AffinityServicer(affinity_pb2_grpc.AffinityServiceServicer):
    """Place, ReleaseLease, the Attach relay, GetSession, ListWorkers and Prepare."""

    def __init__(
        self,
        *,
        placer: Placer,
        relay: Relay,
        streams: AttachLimits,
        attestation: Attestation,
        store: AffinityStore,
        tiers: TierConfig,
        heartbeat_interval_ms: int,
        presence_ttl_ms: int,
        retry_after_s: float,
        max_connection_age_s: float = 0.0,
        decisions: DecisionLogWriter | None = None,
    ) -> None:
        self._retry_after_s = retry_after_s
        #: Where each Place's outcome goes (SPEC Q3): the decision log.
        self._decisions = decisions
        self._max_connection_age_s = max_connection_age_s
        self._placer = placer
        self._relay = relay
        self._streams = streams
        self._attestation = attestation
        self._presence_ttl_s = presence_ttl_ms / 1000
        # The stream each sandbox is attached through on this replica: a newer one
        # ends it at once, so one credential cannot keep many superseded streams
        # (each holding a stream slot until its idle timeout) open (SPEC O6).
        self._attached: dict[str, asyncio.Event] = {}
        self._store = store
        self._tiers = tiers
        self._welcome = affinity_pb2.Welcome(
            heartbeat_interval=_duration(heartbeat_interval_ms),
            presence_ttl=_duration(presence_ttl_ms),
        )

    async def Place(  # noqa: N802 - gRPC method name
        self, request: affinity_pb2.PlaceRequest, context: Context
    ) -> affinity_pb2.PlaceResponse:
        session_id = validation.session_id(request.session_id)
        tier = validation.session_tier(self._tiers, request.tier)
        client = validation.client_id(request.client_id)
        placing = self._placer.place(session_id, tier, client, context.time_remaining())
        if self._decisions is None:
            return _placement(await placing)
        placement = await logged_place(
            self._decisions,
            placing,
            session_id=session_id,
            client=client,
            identity=current_identity(),
        )
        return _placement(placement)

    async def ReleaseLease(  # noqa: N802 - gRPC method name
        self, request: affinity_pb2.ReleaseLeaseRequest, context: Context
    ) -> affinity_pb2.ReleaseLeaseResponse:
        sandbox_id = validation.sandbox_id(request.sandbox_id)
        lease_id = validation.lease_id(request.lease_id)
        client = validation.optional_client_id(request.client_id)
        trace.get_current_span().set_attribute("turnstile.sandbox_id", sandbox_id)
        released = await self._placer.release(sandbox_id, lease_id, client)
        return _RELEASED if released else _NOT_RELEASED

    async def GetSession(  # noqa: N802 - gRPC method name
        self, request: affinity_pb2.GetSessionRequest, context: Context
    ) -> affinity_pb2.GetSessionResponse:
        session_id = validation.session_id(request.session_id)
        client = validation.client_id(request.client_id)
        record = await self._store.session(session_id, client)
        if record is None:
            raise RichError(
                grpc.StatusCode.NOT_FOUND,
                f"session {session_id} has no affinity record",
                reason=reason_name(common_pb2.ERROR_REASON_NOT_FOUND),
                metadata={"session_id": session_id},
            )
        return _session(session_id, record)

    async def Prepare(  # noqa: N802 - gRPC method name
        self, request: affinity_pb2.PrepareRequest, context: Context
    ) -> affinity_pb2.PrepareResponse:
        session_id = validation.session_id(request.session_id)
        client = validation.client_id(request.client_id)
        prepared = await self._placer.prepare(session_id, client, context.time_remaining())
        return _prepared(prepared)

    async def ListWorkers(  # noqa: N802 - gRPC method name
        self, request: affinity_pb2.ListWorkersRequest, context: Context
    ) -> affinity_pb2.ListWorkersResponse:
        tier = validation.list_tier(self._tiers, request.tier)
        client = validation.optional_client_id(request.client_id) or None
        workers = await self._store.workers(tier, client)
        return affinity_pb2.ListWorkersResponse(
            workers=[
                affinity_pb2.Worker(
                    sandbox_id=w.sandbox_id,
                    tier=w.tier,
                    capacity=w.capacity,
                    leases=w.leases,
                    labels=w.labels,
                    client_id=w.client,
                )
                for w in workers
            ]
        )

    async def Attach(  # noqa: N802 - an async generator, as grpc.aio allows
        self,
        request_iterator: AsyncIterator[affinity_pb2.AttachRequest],
        context: Context,
    ) -> AsyncIterator[affinity_pb2.AttachResponse]:
        # Bounded while it waits for its Hello, a slot once attached (SPEC O6).
        async with (
            self._streams.stream(context) as stream,
            aclosing(self._attach(stream, request_iterator)) as responses,
        ):
            async for response in responses:
                yield response

    async def _attach(
        self, stream: AttachStream, request_iterator: AsyncIterator[affinity_pb2.AttachRequest]
    ) -> AsyncGenerator[affinity_pb2.AttachResponse, None]:
        first = await anext(request_iterator, None)
        if first is None or first.WhichOneof("message") != "hello":
            raise bad_field("hello", "the stream's first message must be a Hello")
        hello = validation.hello(first.hello)
        # Verified before anything touches Redis: a refusal changes nothing (SPEC Z3).
        claims = self._attestation.check(hello.sandbox_id, hello.credential)
        stream.attached()
        try:
            attachment = await self._relay.attach(
                hello.sandbox_id, hello.labels, hello.capacity, claims
            )
        except CredentialRefusedError as error:
            raise refusal(hello.sandbox_id, error) from None
        except PresenceTakenError:
            raise RichError(
                grpc.StatusCode.ABORTED,
                f"sandbox {hello.sandbox_id} is attached through another stream, and without "
                "attestation a Hello cannot prove it may take that presence over",
                reason=reason_name(common_pb2.ERROR_REASON_WORKER_CREDENTIAL_REFUSED),
                metadata={"sandbox_id": hello.sandbox_id, "why": "presence_taken"},
                retry_after_s=self._presence_ttl_s,
            ) from None
        superseded = asyncio.Event()
        previous = self._attached.get(attachment.sandbox_id)
        if previous is not None:
            previous.set()
        self._attached[attachment.sandbox_id] = superseded
        # Silent for as long as presence lasts: the worker is gone (SPEC F6).
        watch = StreamWatch(
            self._relay.draining,
            idle_s=self._presence_ttl_s,
            max_age_s=stream_max_age_s(self._max_connection_age_s),
            superseded=superseded,
        )
        drained = False
        try:
            yield affinity_pb2.AttachResponse(welcome=self._welcome)
            async for message in watch.messages(request_iterator):
                kind = message.WhichOneof("message")
                if kind == "heartbeat":
                    if not stream.heartbeat():
                        continue  # past the stream's budget: dropped unanswered
                    await self._relay.heartbeat(attachment)
                    yield affinity_pb2.AttachResponse(heartbeat_ack=affinity_pb2.HeartbeatAck())
                elif kind == "renewal":
                    if not stream.renewal():
                        continue
                    yield await self._renew(attachment, message.renewal)
                elif kind == "goodbye":
                    break
                else:
                    raise bad_field("hello", "only the stream's first message may be a Hello")
            if watch.ended is StreamEnd.SUPERSEDED:
                raise SupersededError(attachment.sandbox_id)
            if watch.ended is not StreamEnd.WORKER:
                # Presence stays: the worker takes it over from its next stream.
                drained = True
                raise RichError(
                    grpc.StatusCode.UNAVAILABLE,
                    "this relay replica is shutting down; attach again"
                    if watch.ended is StreamEnd.DRAINING
                    else "this stream reached its maximum age; attach again",
                    reason=reason_name(common_pb2.ERROR_REASON_DEPENDENCY_UNAVAILABLE),
                    metadata={"sandbox_id": attachment.sandbox_id, "why": watch.ended.value},
                    retry_after_s=0,
                )
        except IdleStreamError:
            raise RichError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no heartbeat from sandbox {attachment.sandbox_id}'s worker for "
                f"{self._presence_ttl_s:g}s; it is detached",
            ) from None
        except SupersededError:
            raise RichError(
                grpc.StatusCode.ABORTED,
                f"a newer stream attached as sandbox {attachment.sandbox_id}",
                reason=reason_name(common_pb2.ERROR_REASON_NOT_FOUND),
                metadata={"sandbox_id": attachment.sandbox_id},
            ) from None
        except CredentialRefusedError as error:
            raise refusal(attachment.sandbox_id, error) from None
        finally:
            if self._attached.get(attachment.sandbox_id) is superseded:
                del self._attached[attachment.sandbox_id]
            if drained:
                self._relay.let_go(attachment, watch.ended.value)
            else:
                await self._relay.detach(attachment)

    async def _renew(
        self, attachment: Attachment, renewal: affinity_pb2.CredentialRenewal
    ) -> affinity_pb2.AttachResponse:
        """Verify a renewed credential for the stream's sandbox; the stream lives on
        (with the presence the renewal attests, SPEC O3)."""
        credential = validation.credential(renewal.credential, "renewal.credential")
        claims = self._attestation.check(attachment.sandbox_id, credential)
        accepted = affinity_pb2.CredentialAccepted()
        if claims is not None:
            await self._relay.renewed(attachment, claims)
            accepted.expires_at.CopyFrom(_timestamp(claims.expires_ms))
        return affinity_pb2.AttachResponse(credential_accepted=accepted)
