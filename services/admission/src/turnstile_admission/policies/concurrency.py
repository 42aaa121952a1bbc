"""Concurrency (SPEC P3): a key's activations in flight.

Every kind takes a lease, resume included; commit or cancel releases it, and it
expires with its hold if the caller dies.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from turnstile_admission.policies.base import FailMode, Policy, PolicyName, PolicySettings


class ConcurrencySettings(PolicySettings):
    """``TURNSTILE_CONCURRENCY__*``."""

    fail: FailMode = FailMode.OPEN
    """Open: leases protect the control plane from slow-request pile-ups, which a
    short Redis outage does not cause; refusing would stop resumes too."""

    default_limit: int = Field(default=10, ge=0, le=1_000_000)
    """Activations a key may have in flight, unless its limits say otherwise."""

    retry_after_s: float = Field(default=1.0, gt=0, le=3600)
    """Retry hint of a concurrency refusal (sooner when a lease expires sooner)."""


class ConcurrencyPolicy(Policy):
    name: ClassVar[PolicyName] = PolicyName.CONCURRENCY
    hint_capped: ClassVar[bool] = True
    settings: ConcurrencySettings
