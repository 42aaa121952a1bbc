"""AdminService requests as data: INVALID_ARGUMENT naming the field, before anything
touches Redis (SPEC M1, X2).

Limits are checked by the one parser the documents have
(:meth:`turnstile_clientkeys.limits.Limits.parse`: each error names its field,
reported here as ``limits.<field>``); a key is named by its client and parsed by
the one client parser (:func:`turnstile_clientkeys.parse_client`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import grpc

from turnstile_admission.admin import KEY_PREFIX, Document, validated
from turnstile_clientkeys import (
    NATIVE,
    SHARED,
    UNATTRIBUTED,
    ClientForm,
    InvalidClientError,
    client_id_problem,
    is_label_value,
    parse_client,
)
from turnstile_clientkeys.contract import limits_target, parse_client_id
from turnstile_clientkeys.keyset import KNOWN_FLAGS
from turnstile_clientkeys.limits import CLUSTER, DEFAULT, LEVELS, LimitsError
from turnstile_contracts import admission_pb2
from turnstile_platform.errors import RichError, bad_field

#: A key's document is named by a client id, ``native`` or ``unattributed``.
TARGET_FORMS = frozenset({ClientForm.CLIENT_ID, ClientForm.NATIVE, ClientForm.UNATTRIBUTED})
#: The fields a patch may name (``update_mask``): the shadow limits change whole.
PATCHABLE = ("cap", "rate", "burst", "concurrency", "weight", "level", "shadow")
_NUMBERS: tuple[Literal["cap", "rate", "burst", "concurrency", "weight"], ...] = (
    "cap",
    "rate",
    "burst",
    "concurrency",
    "weight",
)
_SHADOW_NUMBERS: tuple[Literal["cap", "rate", "burst", "concurrency"], ...] = (
    "cap",
    "rate",
    "burst",
    "concurrency",
)

LEVEL_NAMES: dict[int, str] = {
    admission_pb2.PRIORITY_LEVEL_PLATFORM: "platform",
    admission_pb2.PRIORITY_LEVEL_INTERACTIVE: "interactive",
    admission_pb2.PRIORITY_LEVEL_BATCH: "batch",
}
LEVEL_VALUES = {name: value for value, name in LEVEL_NAMES.items()}
assert set(LEVEL_VALUES) == set(LEVELS)

#: Client ids one GetKeySet resolves, and ids one UpdateKeySet allows or removes, at most.
MAX_RESOLVED = 100
MAX_CHANGED_IDS = 1000
#: What a removal may still name: ids allowlisted before client ids were bounded
#: at 63 characters (``turnstile_clientkeys.keyset``), so they can be removed.
MAX_LEGACY_ID = 253


def target(message: admission_pb2.LimitsTarget, field: str = "target") -> str:
    """The limits hash field a target names (``default``, ``cluster``, ``key:<key>``)."""
    form = message.WhichOneof("target")
    if form == "defaults":
        return DEFAULT
    if form == "cluster":
        return CLUSTER
    if form == "shared":
        return f"{KEY_PREFIX}{SHARED}"
    if form is None:
        raise bad_field(field, "must be set: one of client, shared, defaults, cluster")
    try:
        client = parse_client(message.client, allowed=TARGET_FORMS, field=f"{field}.client")
    except InvalidClientError as error:
        raise bad_field(error.field, error.description) from error
    if client.form is ClientForm.NATIVE:
        return f"{KEY_PREFIX}{NATIVE}"
    if client.form is ClientForm.UNATTRIBUTED:
        return f"{KEY_PREFIX}{UNATTRIBUTED}"
    client_id = client.client_id or ""
    if not is_label_value(client_id):
        raise bad_field(
            f"{field}.client.client_id",
            f"{client_id!r} is not a Kubernetes label value, so it never has a key of its "
            "own (its clients use the shared key): name the shared key instead",
        )
    return f"{KEY_PREFIX}{client_id}"


def target_of(name: str) -> admission_pb2.LimitsTarget:
    """The contract's target for a stored field name."""
    if name == DEFAULT:
        return admission_pb2.LimitsTarget(defaults=admission_pb2.LimitsTarget.Defaults())
    if name == CLUSTER:
        return admission_pb2.LimitsTarget(cluster=admission_pb2.LimitsTarget.Cluster())
    return limits_target(name.removeprefix(KEY_PREFIX))


def _fields(message: admission_pb2.Limits, field: str) -> Document:
    """The fields ``message`` sets, as a document (not yet checked against bounds)."""
    doc: Document = {name: getattr(message, name) for name in _NUMBERS if message.HasField(name)}
    if message.level:
        name = LEVEL_NAMES.get(message.level)
        if name is None:
            raise bad_field(f"{field}.level", f"unknown level {message.level}")
        doc["level"] = name
    if message.HasField("shadow"):
        shadow = message.shadow
        doc["shadow"] = {n: getattr(shadow, n) for n in _SHADOW_NUMBERS if shadow.HasField(n)}
    return doc


def _checked(name: str, document: Document, field: str) -> Document:
    try:
        return validated(name, document)
    except LimitsError as error:
        raise bad_field(f"{field}.{error.field}" if error.field else field, str(error)) from error


def limits(name: str, message: admission_pb2.Limits, field: str = "limits") -> Document:
    """The whole document a SetLimits stores for ``name``."""
    return _checked(name, _fields(message, field), field)


def patch(
    name: str, message: admission_pb2.Limits, paths: Sequence[str], field: str = "limits"
) -> Document:
    """The merge patch a PatchLimits applies: each path in ``paths`` (the update
    mask) takes its value in ``message``, or None (removed) when unset there;
    without paths, the fields ``message`` sets."""
    given = _fields(message, field)
    for index, path in enumerate(paths):
        if path not in PATCHABLE:
            raise bad_field(
                f"update_mask.paths[{index}]",
                f"unknown field {path!r}; one of: {', '.join(PATCHABLE)}",
            )
    # The values set are checked alone (the merged document again, under the
    # transaction): a bad value is refused before Redis is read.
    _checked(name, given, field)
    if not paths:
        return given
    return {path: given.get(path) for path in paths}


def limits_message(document: Mapping[str, Any]) -> admission_pb2.Limits:
    """A stored document as the contract's message (fields it does not know left out)."""
    out = admission_pb2.Limits()
    for name in _NUMBERS:
        value = document.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            setattr(out, name, int(value) if name in ("cap", "concurrency") else float(value))
    level = document.get("level")
    if isinstance(level, str) and level in LEVEL_VALUES:
        out.level = LEVEL_VALUES[level]  # type: ignore[assignment]  # an enum value
    shadow = document.get("shadow")
    if isinstance(shadow, dict):
        out.shadow.SetInParent()
        for name in _SHADOW_NUMBERS:
            value = shadow.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool):
                setattr(
                    out.shadow, name, int(value) if name in ("cap", "concurrency") else float(value)
                )
    return out


class KeySetChange(NamedTuple):
    allow: tuple[str, ...]
    remove: tuple[str, ...]
    flags: dict[str, bool]


def keyset_change(request: admission_pb2.UpdateKeySetRequest) -> KeySetChange:
    """What an UpdateKeySet asks for, each id and flag checked."""
    if not (request.allow or request.remove or request.flags):
        raise bad_field("allow", "nothing to change: give allow, remove or flags")
    for name, ids in (("allow", request.allow), ("remove", request.remove)):
        if len(ids) > MAX_CHANGED_IDS:
            raise bad_field(name, f"at most {MAX_CHANGED_IDS} client ids per call")
    for index, client_id in enumerate(request.allow):
        path = f"allow[{index}]"
        try:
            parse_client_id(client_id, field=path)
        except InvalidClientError as error:
            raise bad_field(error.field, error.description) from error
        if not is_label_value(client_id):
            raise bad_field(
                path,
                f"{client_id!r} is not a Kubernetes label value: allowlisted, it would still "
                "resolve to the shared key",
            )
    for index, client_id in enumerate(request.remove):
        if not client_id or len(client_id) > MAX_LEGACY_ID:
            raise bad_field(f"remove[{index}]", f"must be 1 to {MAX_LEGACY_ID} characters")
    for name in request.flags:
        if name not in KNOWN_FLAGS:
            known = ", ".join(sorted(KNOWN_FLAGS))
            raise bad_field(f"flags[{name!r}]", f"unknown flag; known: {known}")
    return KeySetChange(tuple(request.allow), tuple(request.remove), dict(request.flags))


def resolve_ids(values: Sequence[str]) -> list[str]:
    """The client ids a GetKeySet resolves, each a valid client id."""
    if len(values) > MAX_RESOLVED:
        raise bad_field("client_ids", f"at most {MAX_RESOLVED} client ids per call")
    for index, client_id in enumerate(values):
        problem = client_id_problem(client_id)
        if problem is not None:
            raise bad_field(f"client_ids[{index}]", problem)
    return list(values)


def conflict(error: Exception) -> RichError:
    """A change other writers kept racing: ABORTED, retry it (nothing changed)."""
    return RichError(grpc.StatusCode.ABORTED, f"{error}; nothing changed: retry")
