"""Settings of the affinity service (``TURNSTILE_*``); shared ones come from the platform."""

from __future__ import annotations

from pydantic import Field

from turnstile_platform.settings import ServiceSettings


class AffinitySettings(ServiceSettings):
    """Every affinity knob with its default."""

    port: int = Field(default=50053, ge=0, le=65535)
    metrics_port: int = Field(default=9093, ge=0, le=65535)
