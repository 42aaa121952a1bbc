"""The admin API's audit trail (SPEC M1): one decision-log entry per change.

Every change the AdminService makes (``limits_changed``, ``keys_changed``) is
written here, by :meth:`AuditLog.append` alone, with the caller's identity and the
document before and after, so ``ListDecisions`` (``turnstilectl decisions``) and
a consumer group on the stream (docs/operations.md) see it like any decision.
It goes to the platform's stream (entries of no client: SPEC N3) through the
platform's append script (``decision_append.lua``, the substrate's and affinity's
writer), with the log's bounds, and is awaited: an
operator's change is rare, and its record should exist when the call answers.
The change itself is already made by then; a record Redis refuses is logged and
counted (``turnstile_admission_audit_failures_total``), never silently lost.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import trace
from prometheus_client import Counter

from turnstile_platform.decision_log import bounds, platform_stream, script_text, streams_index
from turnstile_platform.dependencies import DEPENDENCY_ERRORS, DependencyOverloaded
from turnstile_platform.settings import DecisionLogSettings

log = logging.getLogger(__name__)

#: The fields of an audit entry, in this order (the reader: ``decision_log.parse_entry``).
FIELDS = (
    "at",
    "service",
    "kind",
    "trace",
    "sampled",
    "identity",
    "key",
    "target",
    "verb",
    "previous",
    "current",
)

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
    """Writes audit entries to the decision log (the platform stream of admission)."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        prefix: str,
        settings: DecisionLogSettings,
    ) -> None:
        self.stream = platform_stream(prefix)
        self._index = streams_index(prefix)
        self.enabled = settings.max_entries > 0
        # One entry to the platform's stream, in the platform's own append's terms.
        self._head = (*bounds(settings), len(FIELDS), self.stream, "", "")
        self._script = client.register_script(script_text("decision_append.lua"))

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
        context = trace.get_current_span().get_span_context()
        values = (
            str(int(time.time() * 1000)),
            "admission",
            kind,
            format(context.trace_id, "032x") if context.trace_id else "",
            "1" if context.trace_flags.sampled else "0",
            identity,
            key,
            target,
            verb,
            as_json(previous),
            as_json(current),
        )
        args: list[Any] = list(self._head)
        for name, value in zip(FIELDS, values, strict=True):
            args += [name, value]
        try:
            await self._script(keys=[self._index, self.stream], args=args)
        except (*DEPENDENCY_ERRORS, DependencyOverloaded) as error:
            FAILURES.inc()
            log.error(
                "admin change made but its audit entry was not written",
                extra={"kind": kind, "target": target, "identity": identity, "error": str(error)},
            )
            return False
        return True
