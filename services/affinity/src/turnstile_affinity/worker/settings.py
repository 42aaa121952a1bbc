"""Settings of the worker agent, read from the environment.

====================================  ==========================================================
``TURNSTILE_WORKER_SANDBOX_ID``       the sandbox this worker is the runtime of, or:
``TURNSTILE_WORKER_SANDBOX_ID_FILE``  a downward-API labels file to wait on until the pod
                                      carries ``turnstile.dev/sandbox-id`` (set one of the two)
``TURNSTILE_WORKER_KIND``             ``container`` (default) or ``microvm``
``TURNSTILE_WORKER_TIER``             the tier label; unset: the kind's default tier (its name);
                                      set but empty: no tier label at all (SPEC T1)
``TURNSTILE_WORKER_CAPACITY``         concurrent turns it serves (default 1)
``TURNSTILE_WORKER_ENDPOINT``         optional address it serves on, sent as ``endpoint``
``TURNSTILE_WORKER_CREDENTIAL_FILE``  the sandbox credential the substrate keeps current
                                      (SPEC Z3); unset: the Hello carries none
``TURNSTILE_AFFINITY_ADDR``           the affinity relay (default ``127.0.0.1:50053``)
``TURNSTILE_AFFINITY_SPIFFE_ID``      the SPIFFE ID the relay's certificate must hold (default
                                      ``spiffe://turnstile.local/service/affinity``)
``TURNSTILE_WORKER_TLS_CERT_FILE``    the worker's certificate (the sandbox-class SPIFFE ID),
``TURNSTILE_WORKER_TLS_KEY_FILE``     its key and the CA bundle; the Direct substrate passes
``TURNSTILE_WORKER_TLS_CA_FILE``      them (Kubernetes: a mounted Secret)
``TURNSTILE_WORKER_PLAINTEXT``        plaintext to a loopback relay (development only; also
                                      ``TURNSTILE_PLAINTEXT``)
====================================  ==========================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from turnstile_affinity.labels import ENDPOINT_LABEL
from turnstile_clientkeys import is_label_value
from turnstile_platform.settings import LogFormat, ServerSpiffeId
from turnstile_platform.tiers import TIER_LABEL

WorkerKind = Literal["container", "microvm"]


class WorkerSettings(BaseSettings):
    """Every worker-agent knob with its default."""

    model_config = SettingsConfigDict(
        env_prefix="TURNSTILE_WORKER_", extra="ignore", frozen=True, validate_default=True
    )

    sandbox_id: str | None = None
    """The sandbox this worker is the runtime of: a label value of 1 to 63 characters.
    Unset: read from ``sandbox_id_file`` (one of the two must be set)."""

    sandbox_id_file: Path | None = None
    """A downward-API file of the pod's ``metadata.labels``. The worker waits until it
    holds ``turnstile.dev/sandbox-id`` (a warm pod gets it when the substrate adopts
    it), then attaches. Kubernetes sandbox pods use this; the Direct substrate sets
    ``sandbox_id``."""

    sandbox_id_poll_s: float = Field(default=0.5, gt=0, le=60)
    """How often ``sandbox_id_file`` is read while it names no sandbox."""

    credential_file: Path | None = None
    """The file holding this runtime's sandbox credential, minted and renewed by the
    substrate. The worker waits until it exists before it attaches, sends it in its
    Hello and presents a changed one on the live stream. Unset: the Hello carries no
    credential, which a relay enforcing attestation refuses."""

    kind: WorkerKind = "container"
    """What runs the sandbox; its name is the default tier."""

    tier: str | None = None
    """The ``turnstile.dev/tier`` label. Unset (None): the kind's default tier. Set but
    empty: no tier label (the relay then counts the worker as unlabelled)."""

    capacity: int = Field(default=1, ge=1, le=1024)
    """Concurrent turns this worker serves."""

    endpoint: str = Field(default="", max_length=63)
    """Address it serves on (host:port), returned by Place; empty sends no label."""

    affinity_addr: str = Field(
        default="127.0.0.1:50053",
        validation_alias=AliasChoices("TURNSTILE_AFFINITY_ADDR", "affinity_addr"),
    )
    """Where the affinity relay listens (any replica: presence is shared)."""

    affinity_spiffe_id: ServerSpiffeId = Field(
        default="spiffe://turnstile.local/service/affinity",
        validation_alias=AliasChoices(
            "TURNSTILE_WORKER_AFFINITY_SPIFFE_ID",
            "TURNSTILE_AFFINITY_SPIFFE_ID",
            "affinity_spiffe_id",
        ),
    )
    """The SPIFFE ID the relay's certificate must hold: the channel refuses any other
    server (SPEC O5; it checks the DNS name derived from the ID)."""

    tls_cert_file: Path | None = None
    """The worker's certificate: the sandbox class identity
    (``spiffe://<trust-domain>/sandbox``), which the policy lets call ``Attach`` only."""

    tls_key_file: Path | None = None
    """The private key of ``tls_cert_file``."""

    tls_ca_file: Path | None = None
    """The CA bundle the relay's certificate must chain to."""

    plaintext: bool = Field(
        default=False,
        validation_alias=AliasChoices(
            "TURNSTILE_WORKER_PLAINTEXT", "TURNSTILE_PLAINTEXT", "plaintext"
        ),
    )
    """Plaintext to the relay; refused unless ``affinity_addr`` is loopback (SPEC Z5)."""

    reconnect_initial_s: float = Field(default=1.0, gt=0, le=60)
    """The first reconnect after a stream ends waits a random time up to this long;
    the window doubles with each failed attempt (full jitter), so a replica's
    workers do not all come back in the same instant."""

    reconnect_max_s: float = Field(default=10.0, gt=0, le=300)
    """The largest reconnect window; below the relay's presence ttl (15 s), so a
    worker usually re-attaches before its presence lapses."""

    keepalive_time_s: float = Field(default=30.0, ge=10, le=3600)
    """How often the channel pings the relay to keep the connection (and any
    middlebox's state of it) alive; at least the relay's minimum ping interval."""

    welcome_timeout_s: float = Field(default=10.0, gt=0, le=120)
    """How long a new stream waits for the relay's Welcome before it is abandoned
    and retried. A Hello sent on a connection that is going away (a GOAWAY at the
    connection's maximum age racing the new stream, a middlebox that dropped it)
    would otherwise wait for keepalive to notice, or for ever."""

    goodbye_timeout_s: float = Field(default=2.0, gt=0, le=60)
    """On SIGTERM/SIGINT, how long to wait for the relay to close after Goodbye."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", validation_alias=AliasChoices("TURNSTILE_LOG_LEVEL", "log_level")
    )
    log_format: LogFormat = Field(
        default="json", validation_alias=AliasChoices("TURNSTILE_LOG_FORMAT", "log_format")
    )

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if (self.sandbox_id is None) == (self.sandbox_id_file is None):
            raise ValueError(
                "set exactly one of TURNSTILE_WORKER_SANDBOX_ID and "
                "TURNSTILE_WORKER_SANDBOX_ID_FILE"
            )
        if self.sandbox_id is not None and not is_label_value(self.sandbox_id):
            raise ValueError("TURNSTILE_WORKER_SANDBOX_ID must be a label value of 1 to 63 chars")
        if self.tier and not is_label_value(self.tier):
            raise ValueError("TURNSTILE_WORKER_TIER must be empty or a Kubernetes label value")
        return self

    @property
    def tier_label(self) -> str | None:
        """The tier this worker advertises, or None to send no tier label (SPEC T1)."""
        if self.tier is None:
            return self.kind
        return self.tier or None

    @property
    def labels(self) -> dict[str, str]:
        """The Hello's labels."""
        labels: dict[str, str] = {}
        if (tier := self.tier_label) is not None:
            labels[TIER_LABEL] = tier
        if self.endpoint:
            labels[ENDPOINT_LABEL] = self.endpoint
        return labels
