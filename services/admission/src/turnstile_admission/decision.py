"""The Admit decision as data: what the servicer turns into an ``AdmitResponse``."""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

from turnstile_admission.policies import PolicyVerdict, ShadowVerdict, Verdict
from turnstile_clientkeys import BoundedKey


class Decision(NamedTuple):
    """One decision. A named tuple (immutable, built once per Admit at half a
    frozen dataclass's cost)."""

    admitted: bool
    key: BoundedKey
    verdicts: tuple[PolicyVerdict, ...]
    """Every policy's verdict, in evaluation order."""
    hold_id: str = ""
    hold_expires_ms: int = 0
    node: str = ""
    message: str = ""
    shape: Hashable = None
    """What the decision's metrics and the fixed part of its response depend on:
    the key, the outcome, the activation's shape and each policy's verdict (never
    a limit, a count, a hold or a time). Decisions of one shape share them, each
    built once (``Admitter._record``, :class:`~turnstile_admission.responses.AdmitResponses`);
    shapes are bounded by the keys (SPEC C3) times the verdicts. ``None`` for a
    decision built outside the admitter: it shares nothing."""
    dry_run: bool = False
    """Decided without taking anything (SPEC Q4): never a hold."""
    shadow: tuple[ShadowVerdict, ...] = ()
    """The key's shadow limits' verdicts (SPEC Q4), in the script's order."""
    waited_s: float | None = None
    """How long the call waited in the fair queue (None: it did not join it)."""
    queue_position: int = 0
    """Its position among its key's waiters when it joined, or would have joined
    (a dry run, a shadow mode: ``waited_s`` None); 0: neither."""
    estimated_wait_s: float | None = None
    """The wait estimated when it joined or would have (None: neither, or no estimate)."""

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
