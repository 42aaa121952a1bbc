"""The admin API's audit trail (SPEC M1): one decision-log entry per change.

Every change the AdminService makes (``limits_changed``, ``keys_changed``) is
written here, by :meth:`AuditLog.append` alone, with the caller's identity and the
document before and after, so ``ListDecisions`` (``turnstilectl decisions``) and
a consumer group on the stream (docs/operations.md) see it like any decision.
It goes to the platform's stream (entries of no client: SPEC N3) through the
platform's one append for that stream, with the log's bounds, and is awaited: an
operator's change is rare, and its record should exist when the call answers.
The change itself is already made by then; a record Redis refuses is logged and
counted (``turnstile_admission_audit_failures_total``), never silently lost.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import Counter

from turnstile_platform.decision_log import append_platform_entry, platform_stream
from turnstile_platform.dependencies import DEPENDENCY_ERRORS, DependencyOverloaded
from turnstile_platform.settings import DecisionLogSettings

log = logging.getLogger(__name__)

LIMITS_CHANGED = "limits_changed"
KEYS_CHANGED = "keys_changed"

FAILURES = Counter(
    "turnstile_admission_audit_failures_total",
    "AdminService changes made whose decision-log entry Redis did not take (SPEC M1).",
)


def as_json(document: Any) -> str:
    """A document as the entry holds it (empty: none stored)."""
    return "" if document is None else json.dumps(document, sort_keys=True, separators=(",", ":"))


class AuditLog:
    """Writes audit entries to the decision log's platform stream, through the
    platform's one append for it
    (:func:`~turnstile_platform.decision_log.append_platform_entry`)."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        prefix: str,
        settings: DecisionLogSettings,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._settings = settings
        self.stream = platform_stream(prefix)
        self.enabled = settings.max_entries > 0

    async def append(
        self,
        kind: str,
        *,
        identity: str,
        target: str,
        verb: str,
        previous: Any,
        current: Any,
        key: str = "",
    ) -> bool:
        """Write one entry: ``kind`` (:data:`LIMITS_CHANGED`, :data:`KEYS_CHANGED`),
        who (``identity``), what (``target``, ``verb``, the bounded ``key`` of a
        key's document) and the documents before and after. False when it was not
        written (the log is off, or Redis failed the write: logged and counted)."""
        if not self.enabled:
            return False
        change = {
            "target": target,
            "verb": verb,
            "previous": as_json(previous),
            "current": as_json(current),
        }
        try:
            await append_platform_entry(
                self._redis,
                self._prefix,
                self._settings,
                service="admission",
                kind=kind,
                identity=identity,
                key=key,
                extra=change,
            )
        except (*DEPENDENCY_ERRORS, DependencyOverloaded) as error:
            FAILURES.inc()
            log.error(
                "admin change made but its audit entry was not written",
                extra={"kind": kind, "target": target, "identity": identity, "error": str(error)},
            )
            return False
        return True
