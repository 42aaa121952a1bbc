"""Request validation: bad input is INVALID_ARGUMENT naming the field, and changes nothing."""

from __future__ import annotations

import re

from turnstile_clientkeys import is_label_value
from turnstile_contracts import affinity_pb2
from turnstile_platform.errors import bad_field
from turnstile_platform.sandbox_credentials import MAX_CREDENTIAL_CHARS
from turnstile_platform.tiers import TIER_LABEL, TierConfig, UnknownTierError

_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_LEASE_ID = re.compile(r"[0-9a-f]{32}")

#: How many valid sandbox ids are remembered (below).
MAX_REMEMBERED = 4096
# Whether a sandbox id is valid depends on nothing but itself, and every turn's
# ReleaseLease names one of the tier's sandboxes, so valid ones are remembered
# rather than matched against the label-value pattern on every call (0.34 against
# 0.08 µs, docs/performance.md). Callers choose these strings, so the set stops
# growing at MAX_REMEMBERED: later ones are validated every time.
_sandboxes: set[str] = set()

#: Client ids a request may name but never own a session: the reserved keys
#: other than ``native`` (the platform's own sessions, placed on its shared pool).
_NOT_OWNERS = frozenset({"unattributed", "shared"})
# Valid client ids, remembered as valid sandbox ids are (every turn names one).
_clients: set[str] = set()

MAX_CAPACITY = 1024
MAX_LABELS = 64
MAX_LABEL_KEY = 253
MAX_LABEL_VALUE = 63


def session_id(value: str, field: str = "session_id") -> str:
    if not _SESSION_ID.fullmatch(value):
        raise bad_field(field, "must be 1 to 128 characters of [A-Za-z0-9._:-]")
    return value


def sandbox_id(value: str, field: str = "sandbox_id") -> str:
    if value in _sandboxes:
        return value
    if not is_label_value(value):
        raise bad_field(field, "must be a Kubernetes label value of 1 to 63 characters")
    if len(_sandboxes) < MAX_REMEMBERED:
        _sandboxes.add(value)
    return value


def client_id(value: str, field: str = "client_id") -> str:
    """The client a session belongs to (SPEC O2): required; a client id that is a
    Kubernetes label value (what a sandbox's owner is recorded as, so the two can be
    the same), or ``native``."""
    if value in _clients:
        return value
    if not value:
        raise bad_field(
            field, "required: the client the session belongs to (only its sandboxes serve it)"
        )
    if value in _NOT_OWNERS:
        raise bad_field(field, f"{value!r} is reserved and owns no session")
    if not is_label_value(value):
        raise bad_field(
            field,
            "must be a client id of 1 to 63 characters of [A-Za-z0-9._-] (a Kubernetes "
            "label value, as sandbox owners are recorded), or 'native'",
        )
    if len(_clients) < MAX_REMEMBERED:
        _clients.add(value)
    return value


def optional_client_id(value: str, field: str = "client_id") -> str:
    """A client filter: empty for every client (authorization lets only identities
    allowed any client send none), else as :func:`client_id`."""
    return client_id(value, field) if value else ""


def session_tier(tiers: TierConfig, requested: str) -> str:
    """The tier a Place is served in (the default tier for an empty one)."""
    try:
        return tiers.session_tier(requested)
    except UnknownTierError as error:
        raise bad_field("tier", str(error)) from None


def list_tier(tiers: TierConfig, value: str) -> str | None:
    """ListWorkers' tier: None for every worker; an undeclared tier is refused as
    Place refuses it (with no tiers configured, any label value filters)."""
    if not value:
        return None
    if not is_label_value(value):
        raise bad_field("tier", "must be empty or a Kubernetes label value")
    if tiers.enabled and not tiers.is_declared(value):
        return session_tier(tiers, value)
    return value


def lease_id(value: str) -> str:
    if not _LEASE_ID.fullmatch(value):
        raise bad_field("lease_id", "must be a lease id returned by Place")
    return value


def credential(value: str, field: str) -> str:
    """A sandbox credential's size (what it proves is the attestation's to check)."""
    if len(value) > MAX_CREDENTIAL_CHARS:
        raise bad_field(field, f"at most {MAX_CREDENTIAL_CHARS} characters")
    return value


def hello(message: affinity_pb2.Hello) -> affinity_pb2.Hello:
    """A worker's Hello: sandbox id, capacity, and labels within the contract's bounds."""
    sandbox_id(message.sandbox_id, "hello.sandbox_id")
    credential(message.credential, "hello.credential")
    if not 1 <= message.capacity <= MAX_CAPACITY:
        raise bad_field("hello.capacity", f"must be 1 to {MAX_CAPACITY}")
    if len(message.labels) > MAX_LABELS:
        raise bad_field("hello.labels", f"at most {MAX_LABELS} labels")
    for key, value in message.labels.items():
        if not 1 <= len(key) <= MAX_LABEL_KEY:
            raise bad_field("hello.labels", f"keys are 1 to {MAX_LABEL_KEY} characters")
        if len(value) > MAX_LABEL_VALUE:
            raise bad_field(f"hello.labels[{key}]", f"at most {MAX_LABEL_VALUE} characters")
    tier = message.labels.get(TIER_LABEL, "")
    if tier and not is_label_value(tier):
        raise bad_field(f"hello.labels[{TIER_LABEL}]", "must be a Kubernetes label value")
    return message
