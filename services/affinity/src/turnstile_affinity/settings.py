"""Settings of the affinity service (``TURNSTILE_*``); shared ones come from the platform."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator

from turnstile_platform.tiers import TieredSettings


class AffinitySettings(TieredSettings):
    """Every affinity knob with its default."""

    port: int = Field(default=50053, ge=0, le=65535)
    metrics_port: int = Field(default=9093, ge=0, le=65535)

    max_concurrent_streams: int = Field(default=12_000, ge=1, le=100_000)
    """Worker ``Attach`` streams one replica holds at once (SPEC F6: 10,000 and
    room for a rollout's reconnects); ``Place`` keeps ``max_concurrent_rpcs``."""

    max_connection_age_s: float = Field(default=1800.0, ge=0, le=7 * 86_400)
    """After about this long a worker's connection gets GOAWAY, and its stream ends
    (presence kept) between 1.15 and 1.35 times this long after it began, so the
    worker attaches again over a new connection, possibly to another replica: after a
    rollout the fleet evens out within about this long. 0: never."""

    relay_max_redis_calls: int = Field(default=128, ge=1, le=200)
    """The relay's Redis scripts (attach, heartbeat, detach) in flight at once; more
    wait their turn. Below the connection pool's 256, so a reattach storm of
    thousands of workers queues instead of exhausting the pool Place needs too."""

    relay_hello_timeout_s: float = Field(default=5.0, gt=0, le=300)
    """How long a new ``Attach`` stream has to send a Hello that is accepted; then it is
    closed (DEADLINE_EXCEEDED). Until accepted a stream holds no stream slot (SPEC O6)."""

    relay_max_waiting_for_hello: int = Field(default=2048, ge=1, le=100_000)
    """``Attach`` streams that may wait for their Hello at once; one more closes the one
    waiting longest (RESOURCE_EXHAUSTED). Bounds the memory silent streams hold; a
    real worker sends its Hello as it opens the stream, so it waits milliseconds."""

    relay_heartbeats_per_interval: float = Field(default=5.0, ge=1.5, le=1000)
    """Heartbeats one stream may send per heartbeat interval, sustained (the worker
    sends one); more are dropped unanswered, without a Redis script (SPEC O6)."""

    relay_heartbeat_burst: int = Field(default=10, ge=2, le=10_000)
    """Heartbeats one stream may send back to back (a worker catching up after a stall)."""

    relay_renewals_per_minute: float = Field(default=6.0, gt=0, le=6000)
    """Credential renewals one stream may present per minute, sustained (a worker
    presents one each time the substrate renews its credential: minutes apart); more
    are dropped unanswered, without a signature check (SPEC O6)."""

    relay_renewal_burst: int = Field(default=3, ge=1, le=1000)
    """Credential renewals one stream may present back to back."""

    max_connection_age_grace_s: float = Field(default=2700.0, ge=0, le=7 * 86_400)
    """How long a connection past its maximum age stays open for its streams; at
    least 1.5 times ``max_connection_age_s`` (or 0, without limit), so streams end
    on their own, keeping presence, before gRPC closes the connection under them."""

    affinity_ttl_s: int = Field(default=86_400, ge=1, le=30 * 86_400)
    """How long a session's record lives after its last turn (SPEC T3). Detach marks
    live as long, so a session returning late still sees how long its sandbox is gone."""

    grace_s: float = Field(default=60.0, ge=0, le=86_400)
    """How long an absent sandbox keeps its sessions, answering "pending", before
    they fall back to another sandbox of their tier with a workspace reset (SPEC T3)."""

    lease_ttl_s: float = Field(default=600.0, gt=0, le=86_400)
    """How long a Place's lease holds a slot if the caller never releases it (it died)."""

    heartbeat_interval_s: float = Field(default=5.0, gt=0, le=300)
    """How often workers are told to heartbeat (in the Welcome)."""

    presence_ttl_s: float = Field(default=15.0, gt=0, le=3600)
    """A worker's presence expires this long after its last heartbeat: three missed
    heartbeats by default. The relay also ends a stream that stays silent this long
    (the idle timeout): its presence is removed and the detach mark written."""

    retry_after_s: float = Field(default=5.0, gt=0, le=3600)
    """The retry hint of every retryable refusal except "pending", and of "pending"
    when its remaining grace is not a finite number (SPEC T9)."""

    wake_enabled: bool = True
    """Wake an absent sandbox through substrate ``Activate(client=inherit)``, once per
    absence, while its sessions wait out the grace (SPEC T7)."""

    wake_timeout_s: float = Field(default=30.0, gt=0, le=600)
    """Deadline of a wake's Activate call (it may create a pod)."""

    wake_wait_margin_s: float = Field(default=1.0, ge=0, le=600)
    """What a wake keeps back from its Place or Prepare caller's remaining deadline
    when it passes the rest to ``Activate`` as its wait budget: how long admission's
    fair queue may keep the wake when the cluster is contended (SPEC Q1)."""

    worker_attestation: Literal["enforce", "off"] = "enforce"
    """Whether a worker's Hello must carry a sandbox credential the substrate minted
    for that sandbox (SPEC Z3). ``off`` only while rolling out workers that have none:
    any process that reaches the relay may then attach as any sandbox not attached
    at the moment."""

    worker_credential_public_keys_file: Path | None = None
    """PEM file of the Ed25519 public keys sandbox credentials are verified with (one
    or more concatenated ``PUBLIC KEY`` blocks: several during a key rotation);
    re-read within a second of a change. Required while attestation is enforced."""

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.presence_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                "TURNSTILE_PRESENCE_TTL_S must exceed TURNSTILE_HEARTBEAT_INTERVAL_S, "
                "or every worker would flap between present and absent"
            )
        age, grace = self.max_connection_age_s, self.max_connection_age_grace_s
        if age > 0 and 0 < grace < 1.5 * age:
            raise ValueError(
                "TURNSTILE_MAX_CONNECTION_AGE_GRACE_S must be 0 or at least 1.5 times "
                "TURNSTILE_MAX_CONNECTION_AGE_S, or gRPC would cut worker streams (and "
                "detach their sandboxes) before they end on their own"
            )
        if self.worker_attestation == "enforce" and self.worker_credential_public_keys_file is None:
            raise ValueError(
                "TURNSTILE_WORKER_ATTESTATION=enforce needs "
                "TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE (or set it to off)"
            )
        return self
