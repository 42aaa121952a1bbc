"""Affinity's side of the decision log (SPEC Q3): how each ``Place`` found its
sandbox — ``hit``, ``first``, ``fallback`` (with the workspace reset, if any) — or
why it did not (``pending``: the session's sandbox is waking; ``busy``: every
sandbox is taken; ``exhausted``: the tier has none), under the call's trace id.
Entries are queued to :class:`~turnstile_platform.decision_log.DecisionLogWriter`,
off the call's path."""

from __future__ import annotations

from collections.abc import Awaitable

from turnstile_affinity.placement import Placement
from turnstile_platform.decision_log import DecisionLogWriter
from turnstile_platform.errors import RichError

#: The kind a refused Place is logged as, by its error reason.
_REFUSALS = {
    "SANDBOX_PENDING": "pending",
    "SANDBOX_BUSY": "busy",
    "TIER_EXHAUSTED": "exhausted",
}


async def logged_place(
    decisions: DecisionLogWriter | None,
    placing: Awaitable[Placement],
    *,
    session_id: str,
    client: str,
    identity: str,
) -> Placement:
    """``placing``'s placement, its outcome logged; a refusal logged and raised."""
    if decisions is None or not decisions.enabled:
        return await placing
    try:
        placement = await placing
    except RichError as error:
        kind = _REFUSALS.get(error.reason)
        if kind is not None:
            decisions.append(
                kind,
                sandbox_id=error.metadata.get("sandbox_id", ""),
                client=client,
                identity=identity,
                detail=f"session {session_id}: {error.message}",
            )
        raise
    detail = f"session {session_id} {placement.outcome.value} on {placement.sandbox_id}"
    reset = placement.reset
    if reset is not None:
        detail += f"; workspace reset from {reset.from_sandbox_id} ({reset.reason.value})"
    decisions.append(
        placement.outcome.value,
        sandbox_id=placement.sandbox_id,
        client=client,
        identity=identity,
        detail=detail,
    )
    return placement
