"""What the AdminService does (SPEC M1): change the limits documents and the key set,
each change made atomically and recorded in the audit trail.

The documents are validated before they get here (:mod:`.admin_validation`); this
module reads the current document, applies the change in one optimistic
transaction (:meth:`LimitsStore.change`, :meth:`KeySetStore.update`: a racing
writer makes it start again, so concurrent patches keep each other's fields) and
appends one audit entry with the documents before and after (:mod:`.audit`).
No gRPC here: the handlers map these results to the contract.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from turnstile_admission.audit import KEYS_CHANGED, LIMITS_CHANGED, AuditLog
from turnstile_clientkeys import RESERVED_IDS, KeySet, KeySetStore, Resolver
from turnstile_clientkeys.keyset import KNOWN_FLAGS
from turnstile_clientkeys.limits import CLUSTER, ClusterLimits, Limits, LimitsStore, merge_patch

Document = dict[str, Any]

#: The hash field name of a key's document.
KEY_PREFIX = "key:"


@dataclass(frozen=True)
class LimitsChange:
    """What one limits change did: the document before and after (None: none)."""

    previous: Document | None
    current: Document | None
    #: Why the document applies to no client now (empty: it applies).
    warning: str = ""


def validated(name: str, document: Any) -> Document:
    """``document`` as stored for the field ``name`` (raises ``LimitsError``)."""
    return (ClusterLimits if name == CLUSTER else Limits).parse(document).as_dict()


def keyset_document(keyset: KeySet) -> Document:
    """The key set as the contract and the audit trail show it: every known flag
    with its value."""
    return {
        "version": keyset.version,
        "allowlist": sorted(keyset.allowlist),
        "flags": {name: keyset.flag(name) for name in sorted({*KNOWN_FLAGS, *keyset.flags})},
    }


class Admin:
    """The limits hash and the key set, changed for one caller at a time."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        prefix: str,
        resolver: Resolver,
        audit: AuditLog,
    ) -> None:
        self.limits = LimitsStore(client, prefix)
        self.keys = KeySetStore(client, prefix)
        self._resolver = resolver
        self._audit = audit

    async def documents(self, name: str | None) -> list[tuple[str, Document]]:
        """Every stored document by name (``name``: that one, if stored)."""
        if name is not None:
            found = await self.limits.get(name)
            return [] if found is None else [(name, found)]
        return list((await self.limits.show()).items())

    async def set(self, name: str, document: Document, identity: str) -> LimitsChange:
        """Replace ``name``'s document with ``document`` (already validated)."""
        return await self._change(name, "set", lambda _: document, identity)

    async def patch(self, name: str, patch: Document, identity: str) -> LimitsChange:
        """Merge ``patch`` into ``name``'s document (a None value removes a field)."""

        def merged(before: Document | None) -> Document:
            return validated(name, merge_patch(before or {}, patch))

        return await self._change(name, "patch", merged, identity)

    async def delete(self, name: str, identity: str) -> LimitsChange:
        """Remove ``name``'s document (nothing is logged when none was stored)."""
        return await self._change(name, "delete", lambda _: None, identity)

    async def _change(
        self,
        name: str,
        verb: str,
        apply: Callable[[Document | None], Document | None],
        identity: str,
    ) -> LimitsChange:
        previous, current = await self.limits.change(name, apply)
        if previous != current:
            key = name.removeprefix(KEY_PREFIX) if name.startswith(KEY_PREFIX) else ""
            await self._audit.append(
                LIMITS_CHANGED,
                identity=identity,
                target=name,
                verb=verb,
                previous=previous,
                current=current,
                key=key,
            )
        return LimitsChange(previous, current, self._not_in_effect(name, current))

    def _not_in_effect(self, name: str, current: Document | None) -> str:
        """Why a key's document applies to no client now (empty: it applies)."""
        if current is None or not name.startswith(KEY_PREFIX):
            return ""
        key = name.removeprefix(KEY_PREFIX)
        if key in RESERVED_IDS or self._resolver.resolve_id(key).key == key:
            return ""
        return (
            f"{key!r} is not allowlisted (key set v{self._resolver.version}): its clients use "
            f"the shared key, so these limits are not in effect until it is allowed"
        )

    async def keyset(self) -> KeySet:
        return await self.keys.load()

    def resolved(self, client_ids: list[str]) -> list[tuple[str, Any]]:
        """What each id resolves to against the key set this replica has installed."""
        return [(client_id, self._resolver.resolve_id(client_id)) for client_id in client_ids]

    async def update_keyset(
        self,
        allow: tuple[str, ...],
        remove: tuple[str, ...],
        flags: Mapping[str, bool],
        identity: str,
    ) -> tuple[KeySet, KeySet]:
        """One new key-set version (already validated), audited; before and after."""
        before, after = await self.keys.update(allow=allow, remove=remove, flags=flags)
        await self._audit.append(
            KEYS_CHANGED,
            identity=identity,
            target="keyset",
            verb="update",
            previous=keyset_document(before),
            current=keyset_document(after),
        )
        return before, after
