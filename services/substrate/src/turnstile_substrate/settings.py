"""Settings of the substrate service (``TURNSTILE_*``); shared ones come from the platform."""

from __future__ import annotations

from pydantic import Field

from turnstile_platform.settings import ServiceSettings


class SubstrateSettings(ServiceSettings):
    """Every substrate knob with its default."""

    port: int = Field(default=50052, ge=0, le=65535)
    metrics_port: int = Field(default=9092, ge=0, le=65535)
