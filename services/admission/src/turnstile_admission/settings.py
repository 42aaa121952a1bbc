"""Settings of the admission service (``TURNSTILE_*``); shared ones come from the platform.

Each policy's settings are a nested group (``TURNSTILE_CAP__MODE=shadow``,
``TURNSTILE_SLOTS__PER_NODE='{"node-a": 16}'``). Per-key limits are not here:
they live in Redis and change without a restart (see :mod:`turnstile_clientkeys.limits`);
the defaults below apply to keys without limits of their own.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from turnstile_admission.policies import (
    CapSettings,
    ConcurrencySettings,
    RateSettings,
    SlotsSettings,
)
from turnstile_platform.settings import ServiceSettings


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
