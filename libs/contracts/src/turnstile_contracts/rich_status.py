"""The one decoder of a failed call's rich status (SPEC X2).

A Turnstile error carries a packed ``google.rpc.Status`` in its
``grpc-status-details-bin`` trailer, with ``ErrorInfo``, ``RetryInfo``,
``QuotaFailure`` and ``BadRequest`` details. The services' platform, the CLI and
the client library each turn it into their own error type from what
:func:`decode_status` reads here, so the wire format is read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2, status_pb2


@dataclass(frozen=True)
class Violation:
    """One ``QuotaFailure`` entry (subject: a bounded key) or ``BadRequest`` entry
    (subject: the field's path), and why."""

    subject: str
    description: str


@dataclass(frozen=True)
class RichStatus:
    """What a failed call said: its code and message, and its details if any."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    #: ``ErrorInfo.domain``; ``None`` when the status carried no ``ErrorInfo``.
    domain: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    #: ``RetryInfo.retry_delay``; ``None`` when the server sent no retry hint.
    retry_after_s: float | None = None
    quota_violations: tuple[Violation, ...] = ()
    field_violations: tuple[Violation, ...] = ()


def decode_status(error: object) -> RichStatus:
    """Read a client-side RPC error (sync or aio). Errors without rich details (a
    deadline, a dropped connection) keep their code and message only."""
    code: grpc.StatusCode = getattr(error, "code", lambda: grpc.StatusCode.UNKNOWN)()
    message: str = getattr(error, "details", lambda: str(error))() or ""
    reason, domain, metadata = "", None, {}
    retry: float | None = None
    quotas: list[Violation] = []
    fields: list[Violation] = []
    status = _status_from_trailers(error)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry_info = error_details_pb2.RetryInfo()
            detail.Unpack(retry_info)
            retry = retry_info.retry_delay.ToTimedelta().total_seconds()
        elif detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            quota = error_details_pb2.QuotaFailure()
            detail.Unpack(quota)
            quotas.extend(Violation(v.subject, v.description) for v in quota.violations)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            fields.extend(Violation(v.field, v.description) for v in bad.field_violations)
    return RichStatus(
        code=code,
        message=message,
        reason=reason,
        domain=domain,
        metadata=metadata,
        retry_after_s=retry,
        quota_violations=tuple(quotas),
        field_violations=tuple(fields),
    )


def _status_from_trailers(error: object) -> status_pb2.Status | None:
    """The packed ``google.rpc.Status`` in the trailers, sync or aio errors alike."""
    trailers = getattr(error, "trailing_metadata", lambda: ())() or ()
    for key, value in trailers:
        if key == "grpc-status-details-bin" and isinstance(value, bytes):
            status = status_pb2.Status()
            status.MergeFromString(value)
            return status
    return None
