"""The key set: which client ids get a bucket of their own, and the flags.

A key set is an immutable, versioned snapshot. Replicas swap whole snapshots,
so a decision never sees half of a change, and every decision can report the
version it used (SPEC C2).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turnstile_clientkeys.ids import client_id_problem

#: Flags the resolver understands, with their defaults.
KNOWN_FLAGS: Mapping[str, bool] = {
    # When false, every client id resolves to the shared key: a kill switch for
    # per-client buckets that keeps reserved keys as they are.
    "own_keys": True,
}


class KeySetError(ValueError):
    """A key-set document or change is invalid."""


@dataclass(frozen=True)
class KeySet:
    """Allowlist + flags at one version."""

    version: int = 0
    allowlist: frozenset[str] = frozenset()
    flags: Mapping[str, bool] = field(default_factory=lambda: dict(KNOWN_FLAGS))

    def flag(self, name: str) -> bool:
        return bool(self.flags.get(name, KNOWN_FLAGS[name]))

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "allowlist": sorted(self.allowlist),
                "flags": dict(self.flags),
            },
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> KeySet:
        try:
            doc: Any = json.loads(text)
            version = doc["version"]
            allowlist = doc["allowlist"]
            flags = doc.get("flags", {})
        except (ValueError, KeyError, TypeError) as error:
            raise KeySetError(f"malformed key-set document: {error}") from error
        if not isinstance(version, int) or version < 0:
            raise KeySetError("version must be a non-negative integer")
        return cls(version=version, allowlist=_ids(allowlist, strict=False), flags=_flags(flags))

    def changed(
        self,
        *,
        allow: Iterable[str] = (),
        remove: Iterable[str] = (),
        flags: Mapping[str, bool] | None = None,
    ) -> KeySet:
        """The next version with ``allow`` added, ``remove`` removed and ``flags`` set."""
        allowlist = (self.allowlist | _ids(allow)) - _ids(remove, strict=False)
        merged = {**self.flags, **_flags(flags or {})}
        return KeySet(version=self.version + 1, allowlist=frozenset(allowlist), flags=merged)


#: What a stored document or a removal may still name: ids allowlisted before
#: client ids were bounded at 63 characters load (they never match a request)
#: and can be removed; new ones must pass the client-id rule.
_LEGACY_MAX_ID = 253


def _ids(values: Any, *, strict: bool = True) -> frozenset[str]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise KeySetError("allowlist must be a list of client ids")
    ids = frozenset(values)
    for value in ids:
        if not isinstance(value, str):
            raise KeySetError(f"allowlisted id must be a string: {value!r}")
        problem = client_id_problem(value)
        if not strict and value and len(value) <= _LEGACY_MAX_ID:
            problem = None
        if problem is not None:
            raise KeySetError(f"allowlisted id {value!r} {problem}")
    return ids


def _flags(values: Any) -> dict[str, bool]:
    if not isinstance(values, Mapping):
        raise KeySetError("flags must be an object of booleans")
    flags: dict[str, bool] = {}
    for name, value in values.items():
        if name not in KNOWN_FLAGS:
            raise KeySetError(f"unknown flag {name!r}; known: {', '.join(sorted(KNOWN_FLAGS))}")
        if not isinstance(value, bool):
            raise KeySetError(f"flag {name!r} must be true or false")
        flags[name] = value
    return flags
