"""The Admit decision as data: what the servicer turns into an ``AdmitResponse``."""

from __future__ import annotations

from dataclasses import dataclass

from turnstile_admission.policies import PolicyVerdict, Verdict
from turnstile_clientkeys import BoundedKey


@dataclass(frozen=True)
class Decision:
    admitted: bool
    key: BoundedKey
    verdicts: tuple[PolicyVerdict, ...]
    """Every policy's verdict, in evaluation order."""
    hold_id: str = ""
    hold_expires_ms: int = 0
    node: str = ""
    message: str = ""

    @property
    def refused_by(self) -> PolicyVerdict | None:
        """The first enforced policy that refused."""
        return next((v for v in self.verdicts if v.verdict is Verdict.REFUSE), None)

    @property
    def retry_after_s(self) -> float | None:
        """When retrying may succeed: the latest hint of the refusing policies, since
        every one of them must pass."""
        hints = [
            v.retry_after_s
            for v in self.verdicts
            if v.verdict is Verdict.REFUSE and v.retry_after_s is not None
        ]
        return max(hints) if hints else None
