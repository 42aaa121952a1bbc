"""Worker attestation at the relay: a worker attaches only as its own sandbox (SPEC Z3).

A worker's Hello carries the sandbox credential the substrate minted for its
runtime (:mod:`turnstile_platform.sandbox_credentials`). The relay checks the
signature, the sandbox id and the expiry here, in the process, before anything
touches Redis; ``attach.lua`` then checks, atomically with putting presence,
that the credential's generation is still the sandbox's current one (not
revoked). Both refusals are PERMISSION_DENIED with reason
``WORKER_CREDENTIAL_REFUSED`` and ``why`` in the ErrorInfo metadata, counted,
and logged with a throttle: one line per peer identity and ``why`` a minute,
with a count of the rest (SPEC O6).

``TURNSTILE_WORKER_ATTESTATION=off`` accepts Hellos without a credential (for a
rollout whose workers do not have one yet). Off, a Hello never replaces
another stream's live presence: without proof, the sandbox's presence is not
taken from the worker that holds it.
"""

from __future__ import annotations

import logging
from typing import Literal

import grpc

from turnstile_affinity.metrics import CREDENTIAL_REFUSALS
from turnstile_affinity.stream_limits import stream_identity
from turnstile_contracts import common_pb2
from turnstile_platform.errors import RichError, reason_name
from turnstile_platform.log_throttle import LogThrottle
from turnstile_platform.sandbox_credentials import (
    CredentialRefusedError,
    SandboxClaims,
    VerificationKeys,
)

log = logging.getLogger(__name__)

AttestationMode = Literal["enforce", "off"]

REASON = reason_name(common_pb2.ERROR_REASON_WORKER_CREDENTIAL_REFUSED)

#: One "worker credential refused" line per (peer identity, why) a minute, naming
#: the last sandbox id and counting the rest (SPEC O6); the metric counts every one.
REFUSAL_LINES = LogThrottle(log)


def refusal(sandbox_id: str, error: CredentialRefusedError) -> RichError:
    """The PERMISSION_DENIED a refused credential is answered with (counted, logged)."""
    CREDENTIAL_REFUSALS.labels(error.reason).inc()
    identity = stream_identity()
    REFUSAL_LINES.warning(
        (identity, error.reason),
        "worker credential refused",
        {
            "identity": identity or "-",
            "sandbox_id": sandbox_id,
            "why": error.reason,
            "detail": error.detail,
        },
    )
    return RichError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"the worker's credential does not prove it is sandbox {sandbox_id}: {error.detail}",
        reason=REASON,
        metadata={"sandbox_id": sandbox_id, "why": error.reason},
    )


class Attestation:
    """Verifies workers' sandbox credentials against the relay's key set."""

    def __init__(self, mode: AttestationMode, keys: VerificationKeys | None) -> None:
        if mode == "enforce" and keys is None:
            raise ValueError("worker attestation is enforced but no public keys are configured")
        self.mode = mode
        self._keys = keys

    @property
    def enforced(self) -> bool:
        return self.mode == "enforce"

    def check(self, sandbox_id: str, credential: str) -> SandboxClaims | None:
        """The verified claims, or None when attestation is off; raises :class:`RichError`."""
        if self._keys is None or not self.enforced:
            return None
        try:
            return self._keys.verify(credential, sandbox_id)
        except CredentialRefusedError as error:
            raise refusal(sandbox_id, error) from None
