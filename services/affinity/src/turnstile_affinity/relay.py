"""The worker relay: presence of attached workers, shared by every replica through Redis.

A worker's stream is one :class:`Attachment`, owned by a random stream id. Its
Hello clears the sandbox's detach mark and puts presence in one script; its
heartbeats extend presence; its end (Goodbye, a dropped connection, or this
replica shutting down) removes presence and then writes the detach mark, again
in one script (SPEC T5). Only the stream that owns the presence may extend or
end it, so a worker that reconnected through another replica is never removed
by the teardown of its old stream.

If presence disappears under a live stream (Redis restarted, or heartbeats
stalled past the ttl), the next heartbeat attaches again.

With attestation (SPEC Z3) each stream carries its verified credential's
generation and expiry. Every heartbeat checks, in its script, that the
sandbox's credential record still names that generation, and here that the
credential (or its latest renewal) has not expired: a deactivated sandbox's
worker, or one that stopped being renewed, loses its stream within one
heartbeat interval.

The presence put is the credential's, not the Hello's (SPEC O3,
:mod:`turnstile_affinity.attested_presence`): owner, tier, capacity and endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar, cast

from turnstile_affinity.attested_presence import PresenceAttestor
from turnstile_affinity.labels import ENDPOINT_LABEL
from turnstile_affinity.metrics import ATTACHED, ATTACHES, EXCLUDED
from turnstile_affinity.store import AffinityStore
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DEPENDENCY_ERRORS
from turnstile_platform.sandbox_credentials import (
    CLOCK_SKEW_MS,
    CredentialRefusedError,
    SandboxClaims,
    now_ms,
)
from turnstile_platform.tiers import TIER_LABEL, TierConfig

T = TypeVar("T")

log = logging.getLogger(__name__)

#: How many sandbox ids the "excluded" log remembers, so each is logged once.
_EXCLUDED_MEMORY = 100_000


@dataclass
class Attachment:
    """One worker stream's presence, and the credential it proved itself with."""

    sandbox_id: str
    owner: str
    tier: str
    capacity: int
    labels: Mapping[str, str]
    #: The sandbox's owner (a client id, ``native``, or "" for none), as attested.
    client: str = ""
    #: The Hello's own labels and capacity (a renewal's claims are resolved against them).
    declared_labels: Mapping[str, str] | None = None
    declared_capacity: int = 0
    #: The credential's generation; "" when attestation is off.
    generation: str = ""
    #: When the credential (or its latest renewal) expires; 0 when attestation is off.
    credential_expires_ms: int = 0

    @property
    def endpoint(self) -> str:
        return self.labels.get(ENDPOINT_LABEL, "")

    def renewed(self, claims: SandboxClaims) -> None:
        """A renewal was verified: the stream lives on under its new expiry."""
        self.generation = claims.generation
        self.credential_expires_ms = claims.expires_ms


class SupersededError(Exception):
    """A newer stream of the same sandbox took over; this one must end."""


class PresenceTakenError(Exception):
    """Attestation is off and another stream's presence of the sandbox is live."""


class Relay:
    """Attach, heartbeat and detach workers; log excluded workers once each."""

    def __init__(
        self,
        store: AffinityStore,
        tiers: TierConfig,
        *,
        presence_ttl_ms: int,
        mark_ttl_ms: int,
        max_redis_calls: int = 128,
    ) -> None:
        self._store = store
        # Bounds the relay's scripts in flight below the Redis connection pool: a
        # reattach storm of thousands of workers queues here instead of exhausting
        # the pool (whose overflow fails at once) that Place needs too.
        self._redis_calls = asyncio.Semaphore(max_redis_calls)
        self._tiers = tiers
        self._presence_ttl_ms = presence_ttl_ms
        self._mark_ttl_ms = mark_ttl_ms
        self._excluded: OrderedDict[str, None] = OrderedDict()
        self._attestor = PresenceAttestor(tiers)
        # Detaches run to their end on this replica (every replica has its own).
        self._teardowns = BackgroundTasks("affinity relay detaches")
        self.draining = asyncio.Event()

    async def attach(
        self,
        sandbox_id: str,
        labels: Mapping[str, str],
        capacity: int,
        claims: SandboxClaims | None = None,
    ) -> Attachment:
        """Put presence for a Hello (already validated, its credential verified).

        Raises :class:`CredentialRefusedError` (``revoked``) when the credential's
        generation is not the sandbox's current one, and
        :class:`PresenceTakenError` when there is no credential and another
        stream's presence is live; neither writes anything.
        """
        presence = self._attestor.resolve(sandbox_id, labels, capacity, claims)
        attachment = Attachment(
            sandbox_id=sandbox_id,
            owner=uuid.uuid4().hex,
            tier=presence.tier,
            capacity=presence.capacity,
            labels=dict(presence.labels),
            client=presence.client,
            declared_labels=dict(labels),
            declared_capacity=capacity,
            generation=claims.generation if claims else "",
            credential_expires_ms=claims.expires_ms if claims else 0,
        )
        previous = await self._put(attachment)
        self._log_if_excluded(attachment)
        ATTACHED.inc()
        ATTACHES.labels("takeover" if previous else "new").inc()
        log.info(
            "worker attached",
            extra={
                "sandbox_id": sandbox_id,
                "tier": attachment.tier,
                "capacity": attachment.capacity,
                "client": attachment.client,
                "took_over": bool(previous),
            },
        )
        return attachment

    async def renewed(self, attachment: Attachment, claims: SandboxClaims) -> None:
        """A renewal was verified: the stream lives on under its new expiry, and if
        the renewal attests another presence (Kubernetes binds the pod's IP on a
        renewal) that presence is put."""
        attachment.renewed(claims)
        if claims.presence is None:
            return
        presence = self._attestor.resolve(
            attachment.sandbox_id,
            attachment.declared_labels or {},
            attachment.declared_capacity,
            claims,
        )
        if (presence.client, presence.tier, presence.capacity, presence.endpoint) == (
            attachment.client,
            attachment.tier,
            attachment.capacity,
            attachment.endpoint,
        ):
            return
        attachment.client, attachment.tier = presence.client, presence.tier
        attachment.capacity, attachment.labels = presence.capacity, dict(presence.labels)
        try:
            await self._put(attachment)
        except PresenceTakenError:
            raise SupersededError(attachment.sandbox_id) from None

    async def heartbeat(self, attachment: Attachment) -> None:
        """Extend presence; re-attach if it vanished; raise :class:`SupersededError`,
        or :class:`CredentialRefusedError` when the stream's credential expired
        unrenewed or was revoked.

        A heartbeat that cannot reach Redis keeps the stream: presence may lapse
        meanwhile, and the first heartbeat that gets through attaches again.
        """
        expires = attachment.credential_expires_ms
        if expires and expires <= now_ms() - CLOCK_SKEW_MS:
            raise CredentialRefusedError("expired", "the stream's credential expired unrenewed")
        try:
            async with self._redis_calls:
                status = await self._store.heartbeat(
                    sandbox_id=attachment.sandbox_id,
                    owner=attachment.owner,
                    presence_ttl_ms=self._presence_ttl_ms,
                    generation=attachment.generation,
                )
        except DEPENDENCY_ERRORS:
            log.warning(
                "could not extend a worker's presence: Redis unreachable",
                extra={"sandbox_id": attachment.sandbox_id},
            )
            return
        if status == "missing":
            log.warning(
                "presence of an attached worker was gone; attaching it again",
                extra={"sandbox_id": attachment.sandbox_id},
            )
            try:
                await self._put(attachment)
            except PresenceTakenError:
                raise SupersededError(attachment.sandbox_id) from None
        elif status == "superseded":
            raise SupersededError(attachment.sandbox_id)
        elif status == "revoked":
            raise CredentialRefusedError("revoked", "the sandbox's credential was revoked")

    async def detach(self, attachment: Attachment) -> None:
        """Remove presence, then write the detach mark; survives cancellation.

        Runs on every replica, for the streams it holds; the teardown is held by
        this relay until it ends, so a cancelled stream still leaves no presence.
        """
        ATTACHED.dec()
        await self._teardowns.shielded(self._detach(attachment))

    def let_go(self, attachment: Attachment, why: str) -> None:
        """The stream ends keeping its presence (a drain, or its maximum age): the
        worker takes the presence over from its next stream, here or elsewhere."""
        ATTACHED.dec()
        log.info(
            "worker stream ended, presence kept",
            extra={"sandbox_id": attachment.sandbox_id, "why": why},
        )

    async def drain(self) -> None:
        """Shutdown has begun: streams end now and keep their presence.

        Each worker reconnects to another replica within its backoff and takes
        its presence over; presence that nobody takes over expires on its own.
        Ending streams without a detach mark keeps sessions from counting a
        replica's restart as their sandbox leaving.
        """
        self.draining.set()

    async def close(self) -> None:
        """Wait for teardowns still writing (shutdown, before Redis closes)."""
        await self._teardowns.wait()

    async def _detach(self, attachment: Attachment) -> None:
        try:
            removed = await self._remove_presence(attachment)
        except Exception:
            log.warning(
                "could not remove a detached worker's presence; it expires on its own",
                extra={"sandbox_id": attachment.sandbox_id},
                exc_info=True,
            )
            return
        log.info("worker detached", extra={"sandbox_id": attachment.sandbox_id, "removed": removed})

    async def _remove_presence(self, attachment: Attachment) -> bool:
        async with self._redis_calls:
            return await self._store.detach(
                sandbox_id=attachment.sandbox_id,
                owner=attachment.owner,
                mark_ttl_ms=self._mark_ttl_ms,
            )

    async def _put(self, attachment: Attachment) -> str:
        """Put presence; the previous owner ("" if none). Raises when refused."""
        async with self._redis_calls:
            status, owner = await self._store.attach(
                sandbox_id=attachment.sandbox_id,
                owner=attachment.owner,
                client=attachment.client,
                # The owner index placement reads: the tier's, or every tier's (SPEC O2).
                scope=attachment.tier if self._tiers.enabled else "*",
                tier=attachment.tier,
                capacity=attachment.capacity,
                labels=attachment.labels,
                endpoint=attachment.endpoint,
                presence_ttl_ms=self._presence_ttl_ms,
                generation=attachment.generation,
            )
        if status == "revoked":
            raise CredentialRefusedError("revoked", "the sandbox's credential was revoked")
        if status == "taken":
            raise PresenceTakenError(attachment.sandbox_id)
        return owner

    def _log_if_excluded(self, attachment: Attachment) -> None:
        """One log line per sandbox id for a worker placement will never pick (SPEC T6)."""
        if not self._tiers.enabled or self._tiers.is_declared(attachment.tier):
            return
        if attachment.sandbox_id in self._excluded:
            self._excluded.move_to_end(attachment.sandbox_id)
            return
        self._excluded[attachment.sandbox_id] = None
        if len(self._excluded) > _EXCLUDED_MEMORY:
            self._excluded.popitem(last=False)
        why = "unlabelled" if not attachment.tier else "mislabelled"
        EXCLUDED.labels(why).inc()
        log.warning(
            f"{why} worker excluded from placement: its {TIER_LABEL} label is "
            + ("missing" if not attachment.tier else "not a declared tier"),
            extra={
                "sandbox_id": attachment.sandbox_id,
                "tier": attachment.tier,
                "declared_tiers": ",".join(self._tiers.declared),
            },
        )


class StreamEnd(Enum):
    """Why a worker stream's messages stopped."""

    #: The worker ended it (Goodbye, or it closed its side).
    WORKER = "worker"
    #: This replica is shutting down (:meth:`Relay.drain`).
    DRAINING = "draining"
    #: The stream reached its maximum age: the worker should attach again, over a
    #: new connection (its old one got GOAWAY), perhaps to another replica.
    AGED = "aged"
    #: A newer stream of the same sandbox was accepted on this replica.
    SUPERSEDED = "superseded"


class IdleStreamError(Exception):
    """No message from the worker within the idle timeout."""


@dataclass
class StreamWatch:
    """What ends a worker stream besides the worker: a drain, its age, its silence.

    ``idle_s``: a stream with no message for this long raises
    :class:`IdleStreamError` (its worker is gone without closing the connection, or
    stalled). ``max_age_s``: the stream ends itself after this long (None: never).
    :attr:`ended` says why the messages stopped.
    """

    stop: asyncio.Event
    idle_s: float
    max_age_s: float | None = None
    #: Set when a newer stream of the same sandbox was accepted on this replica.
    superseded: asyncio.Event | None = None
    ended: StreamEnd = StreamEnd.WORKER

    async def messages(self, messages: AsyncIterator[T]) -> AsyncIterator[T]:
        """The stream's messages until it ends, is drained, ages out or goes silent."""
        loop = asyncio.get_running_loop()
        ends_at = loop.time() + self.max_age_s if self.max_age_s is not None else None
        stopper = asyncio.ensure_future(self.stop.wait())
        waits: set[asyncio.Future[Any]] = {stopper}
        superseder = None
        if self.superseded is not None:
            superseder = asyncio.ensure_future(self.superseded.wait())
            waits.add(superseder)
        following: asyncio.Future[T | object] | None = None
        try:
            while True:
                timeout = self.idle_s
                if ends_at is not None:
                    timeout = min(timeout, max(0.0, ends_at - loop.time()))
                following = asyncio.ensure_future(_next(messages))
                await asyncio.wait(
                    {following, *waits}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not following.done():
                    following.cancel()
                    following.add_done_callback(_discard_outcome)
                    if superseder is not None and superseder.done():
                        self.ended = StreamEnd.SUPERSEDED
                    elif stopper.done():
                        self.ended = StreamEnd.DRAINING
                    elif ends_at is not None and loop.time() >= ends_at:
                        self.ended = StreamEnd.AGED
                    else:
                        raise IdleStreamError(f"no message for {self.idle_s:g}s")
                    return
                message = following.result()
                if message is _END:
                    return
                yield cast(T, message)
        finally:
            stopper.cancel()
            if superseder is not None:
                superseder.cancel()
            if following is not None and not following.done():
                # The read may still end (the stream closing) after we stopped
                # waiting for it: retrieve its outcome so nothing logs it as lost.
                following.cancel()
                following.add_done_callback(_discard_outcome)


#: What :func:`_next` returns at the end of the stream.
_END = object()


async def _next(messages: AsyncIterator[T]) -> T | object:
    """The next message, or :data:`_END`: a read that ends the stream while nobody
    waits for it (the stream was drained, or the process is exiting) leaves no
    StopAsyncIteration in its task to be logged as never retrieved."""
    try:
        return await anext(messages)
    except StopAsyncIteration:
        return _END


def _discard_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def stream_max_age_s(max_connection_age_s: float, rng: random.Random | None = None) -> float | None:
    """How long one worker stream may live: None without a maximum connection age.

    Between 1.15 and 1.35 times the connection's maximum age, chosen at random per
    stream: gRPC sends GOAWAY at the connection's age ±10%, so by the time the
    stream ends its connection takes no new streams and the worker's next Hello
    goes over a new connection; the spread keeps a replica's workers from all
    reconnecting at once.
    """
    if max_connection_age_s <= 0:
        return None
    return max_connection_age_s * (rng or random).uniform(1.15, 1.35)
