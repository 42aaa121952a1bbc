"""The affinity state machine of ``Place(session, tier)`` for a client (SPEC T7, O2).

A session belongs to the client ``Place`` acts for: its record is that client's
(``session:<client>/<id>``), so another client's session of the same id is another
session, and a turn for it answers exactly as a missing one does. Every branch
below — first turn, hit, busy, pending (and its wake), fallback — stays inside
the client's own sandboxes, plus the ``native`` shared pool where the tier's
settings allow it (``shared_pool``); a recorded sandbox that is no longer one of
those is a fallback (``not_owned``).

One call runs ``place.lua`` (the session's recorded sandbox: hit, busy, pending,
or "must move"), and only when there is no usable record one more script:

- no record → ``claim.lua``: the least-loaded sandbox of the tier, written only
  if the session still has no record (compare-and-claim). A turn that loses the
  race places again and lands on the winner's sandbox: concurrent first turns
  converge.
- gone past the grace, or re-tiered → ``replace.lua``: the least-loaded sandbox
  of the tier, written only if the record still names the sandbox this call saw
  (compare-and-set), with the workspace reset. A turn that loses places again
  and lands where the winner moved the session: it moves once.

A hit is one script, one round trip. Leases are taken only inside those
scripts and only when they place the turn, so every refusal has taken nothing;
if the call fails or is cancelled while a script that may have taken one is in
flight, the lease is returned by its id before the error propagates.
"""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

import grpc
from opentelemetry import trace

from turnstile_affinity.metrics import (
    LEASES_ACQUIRED,
    LEASES_RELEASED,
    PREPARES,
    RESETS,
    leases,
    placements,
)
from turnstile_affinity.retry import pending_retry_after_s
from turnstile_affinity.store import (
    AffinityStore,
    Busy,
    Exhausted,
    Leased,
    MustMove,
    NoRecord,
    Pending,
    Prepared,
    Turn,
)
from turnstile_affinity.wake import Waker
from turnstile_contracts import common_pb2
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.errors import QuotaViolation, RichError, reason_name, retry_later
from turnstile_platform.tiers import TierConfig

log = logging.getLogger(__name__)

#: Rounds of place → claim/replace before giving up. Losing a claim or a
#: compare-and-set means the record now names a sandbox, so the next round
#: settles; a third round needs the record to vanish or move again meanwhile.
MAX_ROUNDS = 3


class PlacementOutcome(enum.Enum):
    """How a Place found its sandbox (``affinity.v1.PlacementOutcome``)."""

    HIT = "hit"
    FIRST = "first"
    FALLBACK = "fallback"


class ResetReason(enum.Enum):
    GRACE_EXPIRED = "grace"
    RETIERED = "retiered"
    NOT_OWNED = "not_owned"


class PrepareOutcome(enum.Enum):
    """What a Prepare did (``affinity.v1.PrepareOutcome``)."""

    RUNNING = "running"
    WAKE_STARTED = "wake_started"
    ALREADY_WAKING = "already_waking"
    NO_SESSION = "no_session"
    WILL_MOVE = "will_move"
    NOT_WOKEN = "not_woken"


@dataclass(frozen=True)
class Preparation:
    """A Prepare's answer: what it did, the sandbox the session's record names, and
    (absent within the grace) how long the session keeps it."""

    outcome: PrepareOutcome
    sandbox_id: str = ""
    remaining_grace_ms: int = 0


@dataclass(frozen=True)
class Reset:
    """The session landed on a fresh workspace (SPEC T7, T8)."""

    from_sandbox_id: str
    to_sandbox_id: str
    at_ms: int
    reason: ResetReason


class Placement(NamedTuple):
    """Where the turn goes, with its lease. A named tuple, built once per placed
    turn (a frozen dataclass of seven fields cost 1.2 µs, this 0.3 µs;
    docs/performance.md)."""

    sandbox_id: str
    tier: str
    lease_id: str
    lease_expires_ms: int
    endpoint: str
    outcome: PlacementOutcome
    reset: Reset | None = None


@dataclass(frozen=True)
class PlacementPolicy:
    """The timings a placement uses, in the store's units."""

    grace_ms: int
    lease_ttl_ms: int
    record_ttl_ms: int
    retry_after_s: float
    filtered: bool


class Placer:
    """Runs the state machine against the store; wakes absent sandboxes."""

    def __init__(
        self,
        store: AffinityStore,
        policy: PlacementPolicy,
        waker: Waker | None,
        tiers: TierConfig | None = None,
    ) -> None:
        self._store = store
        self._policy = policy
        self._waker = waker
        # Whether each tier's sessions may use the native shared pool, looked up once.
        tiers = tiers or TierConfig()
        self._shared = {tier: tiers.settings_for(tier).shared_pool for tier in tiers.declared}
        self._shared_default = tiers.settings_for("").shared_pool
        # Lease returns run to their end on this replica (every replica has its own).
        self._returns = BackgroundTasks("affinity lease returns")

    async def place(
        self, session_id: str, session_tier: str, client: str, remaining_s: float | None = None
    ) -> Placement:
        """Place ``client``'s session's next turn in ``session_tier`` or raise a
        :class:`RichError`. ``remaining_s``: the caller's remaining deadline, which
        bounds how long a wake this turn starts may wait in admission's queue."""
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes(
                {
                    "turnstile.session_id": session_id,
                    "turnstile.tier": session_tier,
                    "turnstile.client_id": client,
                }
            )
        policy = self._policy
        tier_label = session_tier if policy.filtered else "*"
        # 16 random bytes as 32 hex digits, without building a uuid.UUID for its hex.
        lease_id = os.urandom(16).hex()
        turn = Turn(
            session_id,
            session_tier,
            policy.filtered,
            lease_id,
            policy.lease_ttl_ms,
            policy.record_ttl_ms,
            client,
            self._shared.get(session_tier, self._shared_default),
        )
        lease_in_doubt = False
        try:
            for _ in range(MAX_ROUNDS):
                lease_in_doubt = True
                found = await self._store.place(turn, grace_ms=policy.grace_ms)
                lease_in_doubt = False
                if isinstance(found, Leased):
                    return self._placed(span, found, lease_id, PlacementOutcome.HIT, tier_label)
                if isinstance(found, Busy):
                    placements(tier_label, "busy").inc()
                    raise self._busy(session_id, found)
                if isinstance(found, Pending):
                    placements(tier_label, "pending").inc()
                    if found.woke and self._waker is not None:
                        self._waker.wake(
                            found.sandbox_id,
                            session_tier if policy.filtered else "",
                            client,
                            turn.shared,
                            remaining_s,
                        )
                    raise self._pending(session_id, found)
                lease_in_doubt = True
                if isinstance(found, NoRecord):
                    moved = await self._store.claim(turn)
                else:
                    moved = await self._store.replace(
                        turn, expected_sandbox_id=found.sandbox_id, reason=found.reason
                    )
                lease_in_doubt = False
                if isinstance(moved, Leased):
                    first = isinstance(found, NoRecord)
                    outcome = PlacementOutcome.FIRST if first else PlacementOutcome.FALLBACK
                    return self._placed(span, moved, lease_id, outcome, tier_label, found)
                if isinstance(moved, Exhausted):
                    placements(tier_label, "exhausted").inc()
                    raise self._exhausted(session_tier)
                log.debug("placement raced another turn", extra={"session_id": session_id})
            raise self._contended(session_id)
        except DependencyUnavailable:
            if lease_in_doubt:
                # Redis did not answer within the call's budget: return the lease
                # without making the answer wait another budget for it (F3).
                lease_in_doubt = False
                self._return_lease_in_background(lease_id)
            raise
        finally:
            if lease_in_doubt:
                await self._return_lease(lease_id)

    async def prepare(
        self, session_id: str, client: str, remaining_s: float | None = None
    ) -> Preparation:
        """Start the wake of ``client``'s session's absent sandbox ahead of its turn
        (SPEC W2): one script, then at most a wake sent in the background — the
        same single wake a pending ``Place`` starts (whichever comes first takes the
        absence's wake marker). Takes no lease and does not renew the session."""
        span = trace.get_current_span()
        if span.is_recording():
            span.set_attributes({"turnstile.session_id": session_id, "turnstile.client_id": client})
        policy = self._policy
        found: Prepared = await self._store.prepare(
            session_id, client, grace_ms=policy.grace_ms, mark_ttl_ms=policy.record_ttl_ms
        )
        if found.sandbox_id:
            span.set_attribute("turnstile.sandbox_id", found.sandbox_id)
        if found.state == "none":
            outcome = PrepareOutcome.NO_SESSION
        elif found.state == "running":
            outcome = PrepareOutcome.RUNNING
        elif found.state == "moves":
            outcome = PrepareOutcome.WILL_MOVE
        elif self._waker is None:
            outcome = PrepareOutcome.NOT_WOKEN
        elif found.woke:
            outcome = PrepareOutcome.WAKE_STARTED
            tier = found.tier if policy.filtered else ""
            shared = self._shared.get(found.tier, self._shared_default)
            self._waker.wake(found.sandbox_id, tier, client, shared, remaining_s)
        else:
            outcome = PrepareOutcome.ALREADY_WAKING
        PREPARES.labels(outcome.value).inc()
        return Preparation(outcome, found.sandbox_id, found.remaining_grace_ms)

    async def release(self, sandbox_id: str, lease_id: str, client: str = "") -> bool:
        """ReleaseLease: False when it was already released or expired, or was placed
        for another client than ``client`` ("": whoever it was placed for)."""
        released = await self._store.release(lease_id, sandbox_id, client)
        if released:
            LEASES_RELEASED.inc()
        return released

    def _placed(
        self,
        span: trace.Span,
        leased: Leased,
        lease_id: str,
        outcome: PlacementOutcome,
        tier_label: str,
        found: NoRecord | MustMove | None = None,
    ) -> Placement:
        reset = None
        if isinstance(found, MustMove) and leased.reset_at_ms is not None:
            reset = Reset(
                from_sandbox_id=found.sandbox_id,
                to_sandbox_id=leased.sandbox_id,
                at_ms=leased.reset_at_ms,
                reason=ResetReason(found.reason),
            )
            RESETS.labels(tier_label, reset.reason.name.lower()).inc()
            log.info(
                "session moved to a fresh workspace",
                extra={
                    "from_sandbox_id": reset.from_sandbox_id,
                    "to_sandbox_id": reset.to_sandbox_id,
                    "reason": reset.reason.name,
                },
            )
        placement = outcome.value
        placements(tier_label, placement).inc()
        LEASES_ACQUIRED.inc()
        # ``span`` is the call's current span, looked up once by place().
        if span.is_recording():
            span.set_attributes(
                {"turnstile.sandbox_id": leased.sandbox_id, "turnstile.placement": placement}
            )
        return Placement(
            leased.sandbox_id,
            leased.tier,
            lease_id,
            leased.lease_expires_ms,
            leased.endpoint,
            outcome,
            reset,
        )

    async def _return_lease(self, lease_id: str) -> None:
        """Return a lease a failed or cancelled call may hold, even if cancelled again.

        Runs on every replica, for the placements it made."""
        await self._returns.shielded(self._release(lease_id))

    def _return_lease_in_background(self, lease_id: str) -> None:
        """Return a lease without waiting: if Redis is still away it expires on its own.

        Runs on every replica, for the placements it made."""
        self._returns.spawn(self._release(lease_id), name="return a failed placement's lease")

    async def close(self) -> None:
        """Wait for lease returns still in flight (shutdown, before Redis closes)."""
        await self._returns.wait()

    async def _release(self, lease_id: str) -> None:
        try:
            if await self._store.release(lease_id):
                leases("returned").inc()
        except Exception:
            log.warning(
                "could not return the lease of a failed placement; it expires on its own",
                extra={"lease_id": lease_id},
                exc_info=True,
            )

    def _busy(self, session_id: str, busy: Busy) -> RichError:
        trace.get_current_span().set_attribute("turnstile.sandbox_id", busy.sandbox_id)
        return retry_later(
            common_pb2.ERROR_REASON_SANDBOX_BUSY,
            f"sandbox {busy.sandbox_id} of session {session_id} is busy "
            f"({busy.leases} of {busy.capacity} turns)",
            self._policy.retry_after_s,
            sandbox_id=busy.sandbox_id,
            session_id=session_id,
            tier=busy.tier,
            leases=str(busy.leases),
            capacity=str(busy.capacity),
        )

    def _pending(self, session_id: str, pending: Pending) -> RichError:
        trace.get_current_span().set_attribute("turnstile.sandbox_id", pending.sandbox_id)
        return retry_later(
            common_pb2.ERROR_REASON_SANDBOX_PENDING,
            f"sandbox {pending.sandbox_id} of session {session_id} is away; it keeps the "
            f"session for {pending.remaining_grace_ms} ms more",
            pending_retry_after_s(pending.remaining_grace_ms, self._policy.retry_after_s),
            sandbox_id=pending.sandbox_id,
            session_id=session_id,
            remaining_grace_ms=str(pending.remaining_grace_ms),
        )

    def _exhausted(self, session_tier: str) -> RichError:
        where = f"tier {session_tier!r}" if self._policy.filtered else "any tier"
        return RichError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no sandbox in {where} has a free slot",
            reason=reason_name(common_pb2.ERROR_REASON_TIER_EXHAUSTED),
            metadata={"tier": session_tier},
            retry_after_s=self._policy.retry_after_s,
            quota_violations=(
                QuotaViolation(
                    subject=f"tier:{session_tier}",
                    description="every present sandbox is at capacity, or none is attached",
                ),
            ),
        )

    def _contended(self, session_id: str) -> RichError:
        return retry_later(
            common_pb2.ERROR_REASON_SANDBOX_BUSY,
            f"session {session_id} kept moving under concurrent turns; retry",
            self._policy.retry_after_s,
            session_id=session_id,
        )
