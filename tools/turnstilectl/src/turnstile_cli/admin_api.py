"""The admin API's documents as the CLI shows and takes them (SPEC M1).

``limits`` and ``keys`` (and the demo) change limits and the key set through
admission's ``AdminService`` with the caller's certificate: the service
authorizes (operators only), validates and audits each change. What a user types
is a JSON document, as ``turnstile_clientkeys.limits`` stores it; this module
turns it into the contract's ``Limits`` (and a patch's update mask) and back. It
checks only what the message cannot carry (a name it has no field for, a string
where a number goes); bounds are the server's to check, so its answer
(``INVALID_ARGUMENT`` naming the field) is the one rule.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the parser imports nothing of this; protobuf when a command runs
    from turnstile_cli.context import Context
    from turnstile_contracts import admission_pb2

#: The fields of a limits document, and which hold whole numbers.
NUMBERS = ("cap", "rate", "burst", "concurrency", "weight")
WHOLE = frozenset({"cap", "concurrency"})
SHADOW_NUMBERS = ("cap", "rate", "burst", "concurrency")


class DocumentError(ValueError):
    """A document the contract cannot carry (exit 2, nothing sent)."""


def target(key: str | None, *, default: bool = False, cluster: bool = False) -> Any:
    """The ``LimitsTarget`` a command line names (None: none named)."""
    from turnstile_clientkeys.contract import limits_target
    from turnstile_contracts import admission_pb2

    if default:
        return admission_pb2.LimitsTarget(defaults=admission_pb2.LimitsTarget.Defaults())
    if cluster:
        return admission_pb2.LimitsTarget(cluster=admission_pb2.LimitsTarget.Cluster())
    if key is None:
        return None
    return limits_target(key)


def to_message(document: Any) -> tuple[admission_pb2.Limits, list[str]]:
    """``document`` (a JSON object; ``null`` values remove a field, as a merge
    patch) as ``Limits`` and the names it mentions, the update mask of a patch."""
    from turnstile_contracts import admission_pb2

    if not isinstance(document, dict):
        raise DocumentError("limits must be a JSON object, e.g. '{\"cap\": 5}'")
    known = (*NUMBERS, "level", "shadow")
    unknown = sorted(set(document) - set(known))
    if unknown:
        raise DocumentError(f"unknown limits: {', '.join(unknown)}; known: {', '.join(known)}")
    message = admission_pb2.Limits()
    for name in NUMBERS:
        if document.get(name) is not None:
            setattr(message, name, _number(name, document[name]))
    level = document.get("level")
    if level is not None:
        from turnstile_clientkeys.limits import LEVELS  # the store's own list

        if level not in LEVELS:
            raise DocumentError(f"level must be one of {', '.join(LEVELS)}")
        message.level = admission_pb2.PriorityLevel.Value(f"PRIORITY_LEVEL_{level.upper()}")
    shadow = document.get("shadow")
    if shadow is not None:
        if not isinstance(shadow, dict):
            raise DocumentError("shadow must be a JSON object, e.g. '{\"cap\": 5}'")
        unknown = sorted(set(shadow) - set(SHADOW_NUMBERS))
        if unknown:
            raise DocumentError(
                f"shadow: unknown limits: {', '.join(unknown)}; known: {', '.join(SHADOW_NUMBERS)}"
            )
        message.shadow.SetInParent()
        for name in SHADOW_NUMBERS:
            if shadow.get(name) is not None:
                setattr(message.shadow, name, _number(f"shadow.{name}", shadow[name]))
    return message, sorted(document)


def _number(name: str, value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DocumentError(f"{name} must be a number")
    if name.rsplit(".", 1)[-1] in WHOLE:
        if not float(value).is_integer():
            raise DocumentError(f"{name} must be a whole number")
        return int(value)
    return float(value)


def to_document(message: admission_pb2.Limits) -> dict[str, Any]:
    """``Limits`` as the JSON document it is stored as (every field it sets)."""
    from turnstile_contracts import admission_pb2

    out: dict[str, Any] = {}
    for name in NUMBERS:
        if message.HasField(name):  # type: ignore[arg-type]  # one of the optional fields
            out[name] = getattr(message, name)
    if message.level:
        out["level"] = (
            admission_pb2.PriorityLevel.Name(message.level).removeprefix("PRIORITY_LEVEL_").lower()
        )
    if message.HasField("shadow"):
        shadow = message.shadow
        out["shadow"] = {
            name: getattr(shadow, name)
            for name in SHADOW_NUMBERS
            if shadow.HasField(name)  # type: ignore[arg-type]  # one of the optional fields
        }
    return out


def keyset_dict(keyset: admission_pb2.KeySet) -> dict[str, Any]:
    return {
        "version": keyset.version,
        "allowlist": list(keyset.allowlist),
        "flags": dict(sorted(keyset.flags.items())),
    }


async def as_operator(ctx: Context, action: str, call: Awaitable[int]) -> int:
    """``call``'s exit code; when the admin API refused the caller's certificate
    (only an operator's may call it), said plainly, and exit 1. Every other error
    goes on to the CLI's usual handling."""
    import grpc
    import grpc.aio

    from turnstile_client import decode

    try:
        return await call
    except grpc.aio.AioRpcError as error:
        if error.code() != grpc.StatusCode.PERMISSION_DENIED:
            raise
        identity = decode(error).metadata.get("identity", "")
        who = (
            f"this certificate is {identity}" if identity else "this certificate holds no operator"
        )
        ctx.out.failure(
            f"{action}: permission denied: only an operator may read or change limits and the "
            f"key set ({who}); use an operator's certificate (--cert/--key, "
            "TURNSTILE_TLS_CERT_FILE)",
            code="PERMISSION_DENIED",
            reason="PERMISSION_DENIED",
        )
        return 1  # Exit.ERROR
