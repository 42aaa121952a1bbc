"""Settings of the admission service (``TURNSTILE_*``); shared ones come from the platform.

Each policy's settings are a nested group (``TURNSTILE_CAP__MODE=shadow``,
``TURNSTILE_SLOTS__PER_NODE='{"node-a": 16}'``). Per-key limits are not here:
they live in Redis and change without a restart (see :mod:`turnstile_clientkeys.limits`);
the defaults below apply to keys without limits of their own.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from turnstile_admission.policies import (
    CapSettings,
    ConcurrencySettings,
    RateSettings,
    SlotsSettings,
)
from turnstile_clientkeys.limits import LEVELS
from turnstile_platform.settings import ServiceSettings


class QueueSettings(BaseModel):
    """The fair queue (SPEC Q1): where an Admit with a wait budget waits when only
    the cluster bucket refuses it."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    max_wait_s: float = Field(default=30.0, ge=0, le=600)
    """The longest any call waits, whatever its budget; 0 turns queuing off."""

    tick_interval_s: float = Field(default=0.02, gt=0, le=1)
    """How often a replica with waiters runs the grant script (tick.lua)."""

    claim_ttl_s: float = Field(default=2.0, gt=0, le=60)
    """How long a grant waits for its waiter's claim before its tokens go back."""

    owner_ttl_s: float = Field(default=3.0, gt=0, le=60)
    """How long a replica counts as alive after its last tick: the waiters of a
    replica silent longer are dropped, never granted."""

    serving_ttl_s: float = Field(default=1.0, gt=0, le=60)
    """How long the queue's mark (the cluster bucket is the waiters') outlives
    the last tick: calls outside the queue take tokens again this long after
    every replica with waiters stopped."""

    max_waiters: int = Field(default=10_000, ge=1, le=1_000_000)
    """Waiters across the cluster; a call past it is refused at once."""

    max_key_waiters: int = Field(default=1_000, ge=1, le=1_000_000)
    """Waiters one bounded key may have in each queue it waits in (the cluster
    bucket's, a node's slots', its own); a call past it is refused at once, so one
    tenant's flood cannot fill the queue's room (``max_waiters``) for the others."""

    max_grants_per_tick: int = Field(default=200, ge=1, le=10_000)
    """Grants one tick makes at most (bounds one script's run)."""

    sweep_limit: int = Field(default=200, ge=1, le=10_000)
    """Expired waiters one tick removes at most."""

    claim_margin_s: float = Field(default=0.05, ge=0, le=10)
    """Time kept back from a call's deadline for its claim after the wait."""

    fairness_interval_s: float = Field(default=10.0, gt=0, le=300)
    """How often each replica reads the last minute's counts into the fairness
    gauge (``turnstile_admission_queue_fairness``): one script call each time."""

    level_shares: dict[str, float] = Field(
        default_factory=lambda: {"platform": 50.0, "interactive": 35.0, "batch": 15.0}
    )
    """Each priority level's guaranteed share of the cluster bucket while it has
    waiters (SPEC Q2), relative to the others'; a level with none waiting lends its
    share to those that have. Every level of ``platform``, ``interactive`` and
    ``batch`` needs one, greater than 0."""

    default_level: str = "interactive"
    """The level of a key whose limits document names none."""

    @model_validator(mode="after")
    def _levels_known(self) -> QueueSettings:
        if set(self.level_shares) != set(LEVELS) or min(self.level_shares.values()) <= 0:
            raise ValueError(f"level_shares needs a share > 0 for each of {', '.join(LEVELS)}")
        if self.default_level not in LEVELS:
            raise ValueError(f"default_level must be one of {', '.join(LEVELS)}")
        return self


class WarmSettings(BaseModel):
    """The warm-pool refill's reservations (SPEC W3, ``ReserveWarm``): what real
    activations keep for themselves."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    cluster_reserve: float = Field(default=0.25, ge=0, le=1)
    """The share of the cluster bucket's burst the refill leaves to activations: it
    takes a token only while the bucket holds more than this share plus the token."""

    spare_slots: int = Field(default=2, ge=0, le=100_000)
    """Slots every candidate node keeps free for cold creates after a warm pod
    takes one."""

    retry_after_s: float = Field(default=1.0, gt=0, le=3600)
    """Retry hint of a refusal that has no better one (waiters in the fair queue;
    a full node whose slots are all committed)."""


class AdmissionSettings(ServiceSettings):
    """Every admission knob with its default."""

    model_config = SettingsConfigDict(env_nested_delimiter="__", use_attribute_docstrings=True)

    port: int = Field(default=50051, ge=0, le=65535)
    """gRPC port of the admission service."""

    metrics_port: int = Field(default=9091, ge=0, le=65535)
    """Prometheus ``/metrics`` port; 0 disables it."""

    cap: CapSettings = CapSettings()
    """The cap policy (SPEC P1)."""

    rate: RateSettings = RateSettings()
    """The rate policy (SPEC P2)."""

    concurrency: ConcurrencySettings = ConcurrencySettings()
    """The concurrency policy (SPEC P3)."""

    slots: SlotsSettings = SlotsSettings()
    """The node-slot policy (SPEC P4)."""

    queue: QueueSettings = QueueSettings()
    """The fair queue (SPEC Q1)."""

    warm: WarmSettings = WarmSettings()
    """The warm-pool refill's reservations (SPEC W3)."""

    decision_page_limit: int = Field(default=500, ge=1, le=10_000)
    """The most decisions one ``ListDecisions`` call returns."""

    hold_ttl_s: float = Field(default=60.0, gt=0, le=3600)
    """How long an uncommitted hold lives: its lease and node slot free when it
    expires (the caller died). Longer than a pod takes to be created."""

    pending_ttl_s: float = Field(default=120.0, gt=0, le=3600)
    """How long a pending entry counts against the cap if the substrate never
    reports it live. At least the hold TTL; long enough for the reflector to see
    a created pod."""

    test_clock: bool = False
    """Tests only: honour a frozen clock stored in Redis instead of Redis TIME."""

    @model_validator(mode="after")
    def _pending_outlives_hold(self) -> AdmissionSettings:
        if self.pending_ttl_s < self.hold_ttl_s:
            raise ValueError("pending_ttl_s must be at least hold_ttl_s")
        return self
