"""Settings of the admission service (``TURNSTILE_*``); shared ones come from the platform."""

from __future__ import annotations

from pydantic import Field

from turnstile_platform.settings import ServiceSettings


class AdmissionSettings(ServiceSettings):
    """Every admission knob with its default."""

    port: int = Field(default=50051, ge=0, le=65535)
    metrics_port: int = Field(default=9091, ge=0, le=65535)
