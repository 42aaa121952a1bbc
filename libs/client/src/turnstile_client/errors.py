"""One shape for everything a Turnstile call can refuse or fail with (SPEC X2).

A refused ``Admit`` is an OK response whose decision is ``DECISION_REFUSED``; a
refused ``Activate`` is a ``RESOURCE_EXHAUSTED`` error with ``ErrorInfo``,
``RetryInfo`` and ``QuotaFailure`` details. Callers should not need to know which:
both become :class:`Refused`, and every other error becomes :class:`TurnstileError`
with the decoded ``google.rpc.Status`` details. The client does not depend on
the services' platform library, so it stays light; both read the wire format with
the contracts' :func:`~turnstile_contracts.rich_status.decode_status`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from turnstile_contracts import ERROR_DOMAIN, admission_pb2
from turnstile_contracts.rich_status import Violation, decode_status

#: The ``ErrorInfo.reason`` a refused Admit maps to, by refusing policy, as the
#: substrate reports a refused Activate.
_POLICY_REASONS = {
    admission_pb2.POLICY_CAP: "CAP_EXCEEDED",
    admission_pb2.POLICY_RATE: "RATE_LIMITED",
    admission_pb2.POLICY_CONCURRENCY: "CONCURRENCY_LIMITED",
    admission_pb2.POLICY_NODE_SLOTS: "NODE_SLOTS_EXHAUSTED",
}


@dataclass(eq=False)
class TurnstileError(Exception):
    """A failed call, with its status code and the rich details the server sent."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    domain: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None
    quota_violations: Sequence[Violation] = ()
    field_violations: Sequence[Violation] = ()

    def __str__(self) -> str:
        reason = f" ({self.reason})" if self.reason else ""
        return f"{self.code.name}: {self.message}{reason}"

    @property
    def retryable(self) -> bool:
        """Whether the server said a retry may succeed (it sent ``RetryInfo``)."""
        return self.retry_after_s is not None


@dataclass(eq=False)
class Refused(TurnstileError):  # noqa: N818 - the name says what callers catch
    """A limit said no: from a refused ``Admit`` (an OK response) or a refused
    ``Activate`` (``RESOURCE_EXHAUSTED``). ``key`` is the bounded key charged,
    ``policy`` the refusing policy (``cap``, ``rate`` …), ``limit``/``current``
    its numbers, ``retry_after_s`` when retrying may succeed."""

    key: str = ""
    policy: str = ""
    limit: int | None = None
    current: int | None = None


def decode(error: grpc.RpcError) -> TurnstileError:
    """An RPC error as a :class:`TurnstileError`; a limit refusal
    (``RESOURCE_EXHAUSTED`` with a Turnstile ``ErrorInfo``) as :class:`Refused`.
    Errors without details (a deadline, a dropped connection) keep code and message."""
    status = decode_status(error)
    common: dict[str, Any] = {
        "code": status.code,
        "message": status.message,
        "reason": status.reason,
        "domain": status.domain or "",
        "metadata": status.metadata,
        "retry_after_s": status.retry_after_s,
        "quota_violations": status.quota_violations,
        "field_violations": status.field_violations,
    }
    metadata = status.metadata
    if status.code == grpc.StatusCode.RESOURCE_EXHAUSTED and status.domain == ERROR_DOMAIN:
        return Refused(
            **common,
            key=metadata.get("key", ""),
            policy=metadata.get("policy", ""),
            limit=_int(metadata.get("limit")),
            current=_int(metadata.get("current")),
        )
    return TurnstileError(**common)


def refused_admit(response: admission_pb2.AdmitResponse) -> Refused:
    """A refused ``Admit`` response in the same shape as a refused ``Activate``."""
    policy = admission_pb2.Policy.Name(response.refused_by).removeprefix("POLICY_").lower()
    retry = (
        response.retry_after.ToTimedelta().total_seconds()
        if response.HasField("retry_after")
        else None
    )
    return Refused(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        message=response.message or f"refused by the {policy} policy",
        reason=_POLICY_REASONS.get(response.refused_by, "UNSPECIFIED"),
        domain=ERROR_DOMAIN,
        metadata={"key": response.key.key, "policy": policy},
        retry_after_s=retry,
        key=response.key.key,
        policy=policy,
        limit=response.limit,
        current=response.current,
    )


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
