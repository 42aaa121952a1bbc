"""What every policy shares: modes, fail modes, verdicts, and the mapping from the
script's raw answer to a verdict."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, Field


class Mode(enum.StrEnum):
    """A policy's rollout stage (SPEC P5)."""

    OFF = "off"
    """Not evaluated: no Redis work, no state, verdict SKIPPED."""
    SHADOW = "shadow"
    """Decides and keeps its accounting, records a would-be refusal, never refuses."""
    ENFORCE = "enforce"
    """Refuses."""


class FailMode(enum.StrEnum):
    """What a policy answers when Redis cannot be reached (SPEC P5)."""

    OPEN = "open"
    """Admit, with verdict UNKNOWN and a fail-open event counted."""
    CLOSED = "closed"
    """Refuse (REFUSE when enforced, SHADOW_REFUSE in shadow) as backend-unavailable."""


class PolicyName(enum.StrEnum):
    """The policies, in the order they run (see docs/admission.md)."""

    SLOTS = "node_slots"
    CONCURRENCY = "concurrency"
    CAP = "cap"
    RATE = "rate"


class Kind(enum.StrEnum):
    """How an activation makes its runtime exist (``turnstile.common.v1.ActivationKind``)."""

    COLD_CREATE = "cold_create"
    WARM_CLAIM = "warm_claim"
    RESUME = "resume"
    RESTORE = "restore"

    @property
    def creates_runtime(self) -> bool:
        """Whether a new runtime comes to exist (everything but a resume)."""
        return self is not Kind.RESUME


class Verdict(enum.StrEnum):
    PASS = "pass"  # noqa: S105 - a verdict, not a password
    REFUSE = "refuse"
    SHADOW_REFUSE = "shadow_refuse"
    UNKNOWN = "unknown"
    SKIPPED = "skipped"


class PolicySettings(BaseModel):
    """Settings every policy has; each policy subclasses it with its own defaults."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="forbid")

    mode: Mode = Mode.ENFORCE
    """Rollout stage: ``off``, ``shadow`` or ``enforce``."""

    fail: FailMode = FailMode.OPEN
    """What to answer when Redis cannot be reached: ``open`` or ``closed``."""

    retry_after_s: float = Field(default=1.0, gt=0, le=3600)
    """Retry hint of a refusal when the script cannot predict a better one."""


@dataclass(frozen=True)
class RawResult:
    """One policy's part of ``admit.lua``'s answer."""

    code: int
    """0 not evaluated, 1 within the limit, 2 over it, 3 unknown."""
    limit: int
    current: int
    retry_ms: int
    detail: str

    NOT_EVALUATED: ClassVar[int] = 0
    WITHIN: ClassVar[int] = 1
    OVER: ClassVar[int] = 2
    UNKNOWN: ClassVar[int] = 3


class PolicyVerdict(NamedTuple):
    """One policy's part of a decision.

    A named tuple rather than a frozen dataclass: as immutable, and built on every
    decision for each policy evaluated, at half the cost (docs/performance.md)."""

    policy: PolicyName
    mode: Mode
    verdict: Verdict
    limit: int = 0
    current: int = 0
    detail: str = ""
    retry_after_s: float | None = None
    """Set on REFUSE and SHADOW_REFUSE: when retrying may succeed."""

    @property
    def refuses(self) -> bool:
        return self.verdict is Verdict.REFUSE


class ShadowVerdict(NamedTuple):
    """A shadow limit's part of a decision (SPEC Q4): a limit under test beside
    the enforced one, compared with what the enforced policy counted. Reported
    and counted, never refusing."""

    policy: PolicyName
    over: bool
    """Whether the shadow limit was reached: a refusal had it been enforced."""
    limit: int
    current: int

    @property
    def verdict(self) -> Verdict:
        return Verdict.SHADOW_REFUSE if self.over else Verdict.PASS


@dataclass(frozen=True)
class ActivationShape:
    """The shape of an activation asked for (its kind and candidate nodes): what a
    policy looks at to decide whether it applies."""

    kind: Kind
    candidate_nodes: tuple[str, ...]


class Policy:
    """A policy: when it applies, its script mode, and its verdicts."""

    name: ClassVar[PolicyName]
    #: Whether the script's hint is capped by ``retry_after_s``. True where the
    #: script's hint is a worst case (the earliest expiry of what is held: a
    #: lease or slot is usually released by commit or cancel long before it
    #: expires), so callers retry on the setting's schedule instead of waiting
    #: out a dead caller's TTL; false where the hint is exact (rate).
    hint_capped: ClassVar[bool] = False

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings

    @property
    def mode(self) -> Mode:
        return self.settings.mode

    def skip_reason(self, activation: ActivationShape) -> str | None:
        """Why the policy does not apply to ``activation``; None when it does."""
        return None

    def evaluated(self, activation: ActivationShape) -> bool:
        return self.mode is not Mode.OFF and self.skip_reason(activation) is None

    def script_mode(self, activation: ActivationShape) -> int:
        """The mode ``admit.lua`` takes: 0 not evaluated, 1 shadow, 2 enforce."""
        if not self.evaluated(activation):
            return 0
        return 2 if self.mode is Mode.ENFORCE else 1

    def skipped(self, activation: ActivationShape) -> PolicyVerdict:
        reason = "off" if self.mode is Mode.OFF else self.skip_reason(activation) or ""
        return PolicyVerdict(self.name, self.mode, Verdict.SKIPPED, detail=reason)

    def evaluated_verdict(self, raw: RawResult) -> PolicyVerdict:
        """The verdict of an evaluated policy's raw answer (the script evaluated it:
        its code is not NOT_EVALUATED). The decision path knows which policies
        apply from the activation's shape (its plan), so there is no per-call
        applicability test here."""
        if raw.code == RawResult.UNKNOWN:
            return PolicyVerdict(
                self.name, self.mode, Verdict.UNKNOWN, raw.limit, raw.current, raw.detail
            )
        if raw.code == RawResult.WITHIN:
            return PolicyVerdict(self.name, self.mode, Verdict.PASS, raw.limit, raw.current)
        return PolicyVerdict(
            self.name,
            self.mode,
            Verdict.REFUSE if self.mode is Mode.ENFORCE else Verdict.SHADOW_REFUSE,
            raw.limit,
            raw.current,
            raw.detail,
            self.retry_hint(raw.retry_ms),
        )

    def unreachable(self, activation: ActivationShape, detail: str) -> PolicyVerdict:
        """The verdict when Redis cannot be reached, by the policy's fail mode."""
        if not self.evaluated(activation):
            return self.skipped(activation)
        if self.settings.fail is FailMode.OPEN:
            return PolicyVerdict(
                self.name, self.mode, Verdict.UNKNOWN, detail=f"{detail}; failing open"
            )
        return PolicyVerdict(
            self.name,
            self.mode,
            Verdict.REFUSE if self.mode is Mode.ENFORCE else Verdict.SHADOW_REFUSE,
            detail=f"POLICY_BACKEND_UNAVAILABLE: {detail}; failing closed",
            retry_after_s=self.settings.retry_after_s,
        )

    def retry_hint(self, retry_ms: int) -> float:
        """The script's hint when it has one (e.g. when the bucket will hold a token
        again), else the policy's default. An exact hint is never shortened to the
        default: a retry earlier than the script's prediction is refused. A
        worst-case hint (:attr:`hint_capped`) is capped by the default."""
        if retry_ms <= 0:
            return self.settings.retry_after_s
        hint = max(0.001, retry_ms / 1000)
        return min(hint, self.settings.retry_after_s) if self.hint_capped else hint
