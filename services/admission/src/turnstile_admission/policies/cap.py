"""Cap (SPEC P1): a key's live sandboxes plus its pending entries stay under its cap.

Live comes from the live set the substrate's leader keeps in Redis from its
reflector (read inside ``admit.lua``); pending entries (admitted, not yet seen
live) are a sorted set scored by expiry, and the leader moves each id from the
pending set to the live set atomically when its pod is first seen live. The cap
runs on every kind that creates a runtime (cold, warm, restore); a resume reuses
a runtime that is already counted live.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from turnstile_admission.policies.base import (
    ActivationShape,
    FailMode,
    Policy,
    PolicyName,
    PolicySettings,
)


class CapSettings(PolicySettings):
    """``TURNSTILE_CAP__*``."""

    fail: FailMode = FailMode.OPEN
    """Open: a Redis outage should not stop every activation when the substrate still
    works. (An unavailable live count is not a Redis outage: the cap then decides on
    the pending set alone.)"""

    default_cap: int = Field(default=20, ge=0, le=1_000_000)
    """Live + pending sandboxes a key may have, unless its limits say otherwise."""

    retry_after_s: float = Field(default=5.0, gt=0, le=3600)
    """``RetryInfo`` of a cap refusal: how soon asking again is worth it, not when it
    frees (a cap frees only when a sandbox stops, which the refusal's message says).
    Kept so that clients that back off by ``RetryInfo`` poll at a sane pace."""


class CapPolicy(Policy):
    name: ClassVar[PolicyName] = PolicyName.CAP
    settings: CapSettings

    def skip_reason(self, activation: ActivationShape) -> str | None:
        if not activation.kind.creates_runtime:
            return f"not checked for {activation.kind.value}: the runtime is already live"
        return None
