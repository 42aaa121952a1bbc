"""The rich gRPC error model (SPEC X2), built in one place and decoded in one place.

Servers raise :class:`RichError` (or call :func:`abort`) with a status code, an
``ErrorInfo`` reason from ``turnstile.common.v1.ErrorReason`` and, where they help,
``RetryInfo``, ``QuotaFailure`` and ``BadRequest`` details. Clients (services and
the CLI) turn an ``AioRpcError`` back into the same :class:`RichError` with
:func:`decode`.

The status travels through ``context.abort(code, details, trailing_metadata)``
rather than ``abort_with_status``: OpenTelemetry's grpc.aio server
instrumentation wraps only ``abort``, so this keeps the span's status right.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
import grpc.aio
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from turnstile_contracts import ERROR_DOMAIN, common_pb2
from turnstile_contracts.rich_status import decode_status
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable

#: Bounds on what a status carries. A message echoing a 10 KB field would push the
#: status past gRPC's metadata limit, and the caller would see RESOURCE_EXHAUSTED
#: instead of the error; bounding here keeps every error the one that was raised.
MAX_MESSAGE_CHARS = 1024
MAX_DETAIL_CHARS = 256


def bounded(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """``text`` cut to ``limit`` characters, marked when cut."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


@dataclass(frozen=True)
class FieldViolation:
    """One bad field: its path in the request (``client.client_id``) and why."""

    field: str
    description: str


@dataclass(frozen=True)
class QuotaViolation:
    """One limit that was hit: the subject (a bounded key) and what was exceeded."""

    subject: str
    description: str


@dataclass(eq=False)
class RichError(Exception):
    """A gRPC error with its structured details.

    Raise it from a servicer wrapped by :func:`turnstile_platform.server.rich_errors`
    (the bootstrap does this) or pass it to :func:`abort`.
    """

    code: grpc.StatusCode
    message: str
    reason: str = ""
    domain: str = ERROR_DOMAIN
    metadata: Mapping[str, str] = field(default_factory=dict)
    retry_after_s: float | None = None
    quota_violations: Sequence[QuotaViolation] = ()
    field_violations: Sequence[FieldViolation] = ()

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message} ({self.reason})"

    @property
    def retryable(self) -> bool:
        """Whether the server said retrying may succeed."""
        return self.retry_after_s is not None

    def to_status(self) -> grpc.Status:
        """Pack this error as a ``google.rpc.Status`` inside a ``grpc.Status``."""
        details: list[any_pb2.Any] = []
        if self.reason:
            info = error_details_pb2.ErrorInfo(
                reason=self.reason,
                domain=self.domain,
                metadata={bounded(k): bounded(v) for k, v in self.metadata.items()},
            )
            details.append(_pack(info))
        if self.retry_after_s is not None:
            details.append(
                _pack(error_details_pb2.RetryInfo(retry_delay=_duration(self.retry_after_s)))
            )
        if self.quota_violations:
            quota = error_details_pb2.QuotaFailure(
                violations=[
                    error_details_pb2.QuotaFailure.Violation(
                        subject=bounded(v.subject), description=bounded(v.description)
                    )
                    for v in self.quota_violations
                ]
            )
            details.append(_pack(quota))
        if self.field_violations:
            bad = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(
                        field=bounded(v.field), description=bounded(v.description)
                    )
                    for v in self.field_violations
                ]
            )
            details.append(_pack(bad))
        status = status_pb2.Status(
            code=_code_number(self.code),
            message=bounded(self.message, MAX_MESSAGE_CHARS),
            details=details,
        )
        return rpc_status.to_status(status)


def reason_name(reason: common_pb2.ErrorReason.ValueType) -> str:
    """The ``ErrorInfo.reason`` string of an ``ErrorReason`` value (prefix dropped)."""
    name: str = common_pb2.ErrorReason.Name(reason)
    return name.removeprefix("ERROR_REASON_")


def retry_later(
    reason: common_pb2.ErrorReason.ValueType,
    message: str,
    retry_after_s: float | None,
    **metadata: str,
) -> RichError:
    """``UNAVAILABLE``: nothing was done and a retry (after ``retry_after_s``) may
    succeed, with its ``ErrorInfo`` reason and metadata."""
    return RichError(
        code=grpc.StatusCode.UNAVAILABLE,
        message=message,
        reason=reason_name(reason),
        metadata=metadata,
        retry_after_s=retry_after_s,
    )


def conflict(
    reason: common_pb2.ErrorReason.ValueType,
    message: str,
    retry_after_s: float | None,
    **metadata: str,
) -> RichError:
    """``ABORTED``: the call met another in progress on the same object and did
    nothing; a retry (after ``retry_after_s``) may succeed, once that one ends."""
    return RichError(
        code=grpc.StatusCode.ABORTED,
        message=message,
        reason=reason_name(reason),
        metadata=metadata,
        retry_after_s=retry_after_s,
    )


def dependency_error(
    error: DependencyUnavailable | DependencyOverloaded, retry_after_s: float
) -> RichError:
    """The one answer to a failing dependency (the platform interceptor's, SPEC X2):
    ``UNAVAILABLE`` with ``DEPENDENCY_UNAVAILABLE`` (the dependency cannot serve)
    or ``REPLICA_OVERLOADED`` (this replica could not get its call done: nothing
    was decided, a retry elsewhere may succeed), the dependency named in the
    metadata, and a retry hint. The message names no host or library error."""
    what = error.dependency
    if isinstance(error, DependencyOverloaded):
        return retry_later(
            common_pb2.ERROR_REASON_REPLICA_OVERLOADED,
            f"this replica is overloaded: its {what} call could not complete in "
            "time; nothing was decided, retry (on another replica if you can)",
            retry_after_s,
            dependency=what,
        )
    return retry_later(
        common_pb2.ERROR_REASON_DEPENDENCY_UNAVAILABLE,
        f"{what} is unavailable; retry",
        retry_after_s,
        dependency=what,
    )


def invalid_argument(*violations: FieldViolation, message: str | None = None) -> RichError:
    """An INVALID_ARGUMENT error naming every bad field (SPEC X2)."""
    text = message or "; ".join(f"{v.field}: {v.description}" for v in violations)
    return RichError(
        code=grpc.StatusCode.INVALID_ARGUMENT,
        message=text,
        reason=reason_name(common_pb2.ERROR_REASON_INVALID_FIELD),
        metadata={"field": violations[0].field} if violations else {},
        field_violations=violations,
    )


def bad_field(path: str, description: str) -> RichError:
    """Shorthand for one bad field."""
    return invalid_argument(FieldViolation(path, description))


async def abort(context: grpc.aio.ServicerContext[Any, Any], error: RichError) -> NoReturn:
    """Abort the RPC with ``error``'s rich status (always raises)."""
    status = error.to_status()
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("context.abort returned")  # pragma: no cover


def decode(error: grpc.aio.AioRpcError | grpc.RpcError) -> RichError:
    """Turn a client-side RPC error back into a :class:`RichError`.

    Errors without rich details (a deadline, a dropped connection) decode with
    their code and message only.
    """
    status = decode_status(error)
    return RichError(
        code=status.code,
        message=status.message,
        reason=status.reason,
        domain=ERROR_DOMAIN if status.domain is None else status.domain,
        metadata=status.metadata,
        retry_after_s=status.retry_after_s,
        quota_violations=tuple(
            QuotaViolation(v.subject, v.description) for v in status.quota_violations
        ),
        field_violations=tuple(
            FieldViolation(v.subject, v.description) for v in status.field_violations
        ),
    )


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _duration(seconds: float) -> duration_pb2.Duration:
    if not math.isfinite(seconds) or seconds < 0:
        seconds = 0.0
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=round((seconds - whole) * 1e9))


def _code_number(code: grpc.StatusCode) -> int:
    number = code.value[0]
    assert isinstance(number, int)
    return number if number in code_pb2.Code.values() else code_pb2.UNKNOWN
