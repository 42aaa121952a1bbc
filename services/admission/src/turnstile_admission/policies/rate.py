"""Rate (SPEC P2): a key's token bucket and the cluster bucket, taken together.

Charged on every kind that creates a runtime, warm claims included. Tokens are
taken as part of a hold; cancelling the hold returns them without over-crediting
either bucket.
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


class RateSettings(PolicySettings):
    """``TURNSTILE_RATE__*``."""

    fail: FailMode = FailMode.OPEN
    """Open: the buckets live only in Redis; refusing everything during an outage
    would turn a Redis blip into a platform outage, and the concurrency limit and
    the cap still bound a burst once Redis returns."""

    default_rate_per_s: float = Field(default=2.0, gt=0, le=1_000_000)
    """Tokens a key's bucket gains per second, unless its limits say otherwise."""

    default_burst: float = Field(default=20.0, ge=1, le=1_000_000)
    """Capacity of a key's bucket, unless its limits say otherwise."""

    cluster_rate_per_s: float = Field(default=50.0, gt=0, le=1_000_000)
    """Tokens the cluster bucket gains per second: what the control plane can create."""

    cluster_burst: float = Field(default=200.0, ge=1, le=1_000_000)
    """Capacity of the cluster bucket."""

    cost: float = Field(default=1.0, gt=0, le=1000)
    """Tokens one activation takes from each bucket."""


class RatePolicy(Policy):
    name: ClassVar[PolicyName] = PolicyName.RATE
    settings: RateSettings

    def skip_reason(self, activation: ActivationShape) -> str | None:
        if not activation.kind.creates_runtime:
            return f"not charged for {activation.kind.value}: no runtime is created"
        return None
