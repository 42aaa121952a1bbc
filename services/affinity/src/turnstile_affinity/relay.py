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
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from turnstile_affinity.labels import ENDPOINT_LABEL
from turnstile_affinity.metrics import ATTACHED, EXCLUDED
from turnstile_affinity.store import AffinityStore
from turnstile_platform.redis_client import UNREACHABLE
from turnstile_platform.tiers import TIER_LABEL, TierConfig

log = logging.getLogger(__name__)

#: How many sandbox ids the "excluded" log remembers, so each is logged once.
_EXCLUDED_MEMORY = 100_000


@dataclass(frozen=True)
class Attachment:
    """One worker stream's presence."""

    sandbox_id: str
    owner: str
    tier: str
    capacity: int
    labels: Mapping[str, str]

    @property
    def endpoint(self) -> str:
        return self.labels.get(ENDPOINT_LABEL, "")


class SupersededError(Exception):
    """A newer stream of the same sandbox took over; this one must end."""


class Relay:
    """Attach, heartbeat and detach workers; log excluded workers once each."""

    def __init__(
        self,
        store: AffinityStore,
        tiers: TierConfig,
        *,
        presence_ttl_ms: int,
        mark_ttl_ms: int,
    ) -> None:
        self._store = store
        self._tiers = tiers
        self._presence_ttl_ms = presence_ttl_ms
        self._mark_ttl_ms = mark_ttl_ms
        self._excluded: OrderedDict[str, None] = OrderedDict()
        self._detaching: set[asyncio.Task[bool]] = set()

    async def attach(self, sandbox_id: str, labels: Mapping[str, str], capacity: int) -> Attachment:
        """Put presence for a Hello (already validated)."""
        attachment = Attachment(
            sandbox_id=sandbox_id,
            owner=uuid.uuid4().hex,
            tier=labels.get(TIER_LABEL, ""),
            capacity=capacity,
            labels=dict(labels),
        )
        self._log_if_excluded(attachment)
        previous = await self._put(attachment)
        ATTACHED.inc()
        log.info(
            "worker attached",
            extra={
                "sandbox_id": sandbox_id,
                "tier": attachment.tier,
                "capacity": capacity,
                "took_over": bool(previous),
            },
        )
        return attachment

    async def heartbeat(self, attachment: Attachment) -> None:
        """Extend presence; re-attach if it vanished; raise :class:`SupersededError`.

        A heartbeat that cannot reach Redis keeps the stream: presence may lapse
        meanwhile, and the first heartbeat that gets through attaches again.
        """
        try:
            status = await self._store.heartbeat(
                sandbox_id=attachment.sandbox_id,
                owner=attachment.owner,
                presence_ttl_ms=self._presence_ttl_ms,
            )
        except UNREACHABLE:
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
            await self._put(attachment)
        elif status == "superseded":
            raise SupersededError(attachment.sandbox_id)

    async def detach(self, attachment: Attachment) -> None:
        """Remove presence, then write the detach mark; survives cancellation."""
        ATTACHED.dec()
        task = asyncio.ensure_future(
            self._store.detach(
                sandbox_id=attachment.sandbox_id,
                owner=attachment.owner,
                mark_ttl_ms=self._mark_ttl_ms,
            )
        )
        self._detaching.add(task)
        task.add_done_callback(self._detaching.discard)
        try:
            removed = await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning(
                "could not remove a detached worker's presence; it expires on its own",
                extra={"sandbox_id": attachment.sandbox_id},
                exc_info=True,
            )
            return
        log.info("worker detached", extra={"sandbox_id": attachment.sandbox_id, "removed": removed})

    async def close(self) -> None:
        """Wait for teardowns still writing (shutdown, before Redis closes)."""
        await asyncio.gather(*self._detaching, return_exceptions=True)

    async def _put(self, attachment: Attachment) -> str:
        return await self._store.attach(
            sandbox_id=attachment.sandbox_id,
            owner=attachment.owner,
            tier=attachment.tier,
            capacity=attachment.capacity,
            labels=attachment.labels,
            endpoint=attachment.endpoint,
            presence_ttl_ms=self._presence_ttl_ms,
        )

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
