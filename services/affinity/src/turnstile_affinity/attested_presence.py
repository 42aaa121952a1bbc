"""What a worker's presence says, taken from its credential, not its Hello (SPEC O3).

The Hello is written by the sandbox's own (untrusted) code. Its sandbox id is
proved by the credential (SPEC Z3); everything placement relies on besides —
the sandbox's owner, its tier, its capacity and its endpoint — comes from the
credential's presence claims too, which the substrate minted from what it
started (:class:`turnstile_platform.sandbox_credentials.PresenceClaims`):

- a Hello that contradicts a claim (its tier label, its capacity, its
  ``endpoint`` label) is **overridden**, not refused: the worker is the
  sandbox's real runtime (its credential says so), and refusing would only
  keep a misconfigured one out of placement. Each override is one throttled
  warning per sandbox and reason (:class:`~turnstile_platform.log_throttle.LogThrottle`);
- the capacity is bounded by the tier's ``max_capacity``
  (``TURNSTILE_TIER_SETTINGS``), whatever the credential says;
- a credential minted before presence claims existed (``presence`` None) is
  **ownerless**: its tier, capacity (bounded) and endpoint are the Hello's, and no
  client's session is ever placed on it (placement's candidates are a client's
  own sandboxes and the ``native`` pool only), so nothing it declares can steer a
  tenant's turn;
- attestation off (no claims at all): the Hello is believed — its tier label,
  its capacity (bounded), its endpoint label and its owner label
  (``turnstile.dev/client-id``, absent: ownerless). That is a rollout mode: tenant
  isolation between sandboxes holds only with attestation on (docs/security.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from turnstile_affinity.labels import ENDPOINT_LABEL, OWNER_LABEL
from turnstile_affinity.metrics import PRESENCE_OVERRIDES
from turnstile_platform.log_throttle import LogThrottle
from turnstile_platform.sandbox_credentials import SandboxClaims
from turnstile_platform.tiers import TIER_LABEL, TierConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Presence:
    """The presence the relay puts for a worker: attested where a credential says so."""

    #: The sandbox's owner: a client id, ``native``, or "" (none: never a candidate).
    client: str
    tier: str
    capacity: int
    endpoint: str
    #: The Hello's labels with the tier and endpoint labels set to the values above.
    labels: Mapping[str, str]
    #: Whether owner, tier, capacity and endpoint came from a credential.
    attested: bool


class PresenceAttestor:
    """Resolves a Hello and its verified claims into the :class:`Presence` to put."""

    def __init__(self, tiers: TierConfig, *, log_interval_s: float = 60.0) -> None:
        self._tiers = tiers
        self._warnings = LogThrottle(log, interval_s=log_interval_s)

    def resolve(
        self,
        sandbox_id: str,
        labels: Mapping[str, str],
        capacity: int,
        claims: SandboxClaims | None,
    ) -> Presence:
        attested = claims.presence if claims is not None else None
        declared_tier = labels.get(TIER_LABEL, "")
        declared_endpoint = labels.get(ENDPOINT_LABEL, "")
        if attested is None:
            client = labels.get(OWNER_LABEL, "") if claims is None else ""
            tier, endpoint, wanted = declared_tier, declared_endpoint, capacity
        else:
            client, tier, endpoint, wanted = (
                attested.owner,
                attested.tier,
                attested.endpoint,
                attested.capacity,
            )
            for reason, said, truth in (
                ("tier", declared_tier, tier),
                ("capacity", str(capacity), str(wanted)),
                ("endpoint", declared_endpoint, endpoint),
            ):
                if said != truth:
                    self._override(sandbox_id, reason, said, truth)
        bound = self._tiers.settings_for(tier).max_capacity
        if wanted > bound:
            self._override(sandbox_id, "capacity_bound", str(wanted), str(bound))
            wanted = bound
        out = {k: v for k, v in labels.items() if k not in (TIER_LABEL, ENDPOINT_LABEL)}
        out.pop(OWNER_LABEL, None)
        if tier:
            out[TIER_LABEL] = tier
        if endpoint:
            out[ENDPOINT_LABEL] = endpoint
        if client:
            out[OWNER_LABEL] = client
        return Presence(client, tier, wanted, endpoint, out, attested is not None)

    def _override(self, sandbox_id: str, reason: str, said: str, truth: str) -> None:
        PRESENCE_OVERRIDES.labels(reason).inc()
        self._warnings.warning(
            (sandbox_id, reason),
            "worker's Hello contradicts what the substrate started; overridden"
            if reason != "capacity_bound"
            else "worker's capacity is above its tier's bound; bounded",
            {
                "sandbox_id": sandbox_id,
                "why": reason,
                "declared": said[:64],
                "attested": truth,
            },
        )
