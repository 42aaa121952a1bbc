"""API errors rendered as ``Status`` objects, shaped like the real API server's.

Clients branch on ``code`` and ``reason`` (kubernetes-asyncio raises ``ApiException`` with the HTTP
status; client-go maps ``reason`` to ``IsNotFound``/``IsConflict``/``IsResourceExpired``), so every
failure path in the emulator goes through one of these builders rather than ad-hoc dicts.
"""

from __future__ import annotations

from typing import Any

#: Message of the API server's optimistic-lock failure (``storage.OptimisticLockErrorMsg``).
OPTIMISTIC_LOCK_MESSAGE = (
    "the object has been modified; please apply your changes to the latest version and try again"
)

#: HTTP code -> the ``reason`` the API server reports when nothing more specific applies.
DEFAULT_REASONS: dict[int, str] = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """A request failure carrying the HTTP code and the ``Status`` body to send back."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else DEFAULT_REASONS.get(code, "")
        self.details = details

    def status(self) -> dict[str, Any]:
        """The ``Status`` object, field for field as the API server writes it."""
        return status_object(self.code, self.message, self.reason, self.details)


def status_object(
    code: int, message: str, reason: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Build a failure ``Status`` (``metav1.Status``); empty fields are omitted as in Go."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
    }
    if reason:
        body["reason"] = reason
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


def not_found(name: str) -> ApiError:
    """``pods "x" not found`` (404 NotFound)."""
    return ApiError(404, f'pods "{name}" not found', "NotFound", {"name": name, "kind": "pods"})


def already_exists(name: str) -> ApiError:
    """``pods "x" already exists`` (409 AlreadyExists), returned by create on a taken name."""
    return ApiError(
        409, f'pods "{name}" already exists', "AlreadyExists", {"name": name, "kind": "pods"}
    )


def conflict(name: str, why: str = OPTIMISTIC_LOCK_MESSAGE) -> ApiError:
    """``Operation cannot be fulfilled on pods "x": ...`` (409 Conflict)."""
    return ApiError(
        409,
        f'Operation cannot be fulfilled on pods "{name}": {why}',
        "Conflict",
        {"name": name, "kind": "pods"},
    )


def invalid(name: str, field: str, detail: str) -> ApiError:
    """``Pod "x" is invalid: field: detail`` (422 Invalid), the validation failure shape."""
    return ApiError(
        422,
        f'Pod "{name}" is invalid: {field}: {detail}',
        "Invalid",
        {
            "name": name,
            "kind": "Pod",
            "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": field}],
        },
    )


def bad_request(message: str) -> ApiError:
    """400 BadRequest, used for unparsable bodies, selectors and query parameters."""
    return ApiError(400, message, "BadRequest")


def expired(message: str) -> ApiError:
    """410 Expired: the requested resourceVersion or continue token was compacted away."""
    return ApiError(410, message, "Expired")


def too_old_watch(requested: int, compacted: int) -> ApiError:
    """The error a watch from a compacted resourceVersion gets, inside an ERROR event."""
    return expired(f"too old resource version: {requested} ({compacted})")
