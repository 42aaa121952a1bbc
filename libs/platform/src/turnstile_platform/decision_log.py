"""The decision log's shared parts (SPEC Q3, N3): its keys, its bounds, the writer the
substrate and affinity append their side of a call with, and the platform's append.

The log is one Redis stream per bounded key, ``<prefix>{adm}:decisions:k:<key>``,
beside the platform's own, ``<prefix>{adm}:decisions:platform`` (entries charged to
no client, and operators' audit entries: :func:`append_platform_entry`), all in
admission's hash slot. Each stream has its own bounds (``_decision_stream.lua``),
so one client's flood trims only its own history, and a client's read is an
XREVRANGE of its stream alone. Admission's decision script appends each ``Admit``
decision itself, atomically with it. The substrate (``Activate``: its outcome and
why) and affinity (``Place``: hit, first, fallback with the reset, pending, busy)
add their entries for the same trace through :class:`DecisionLogWriter`: off the
call path, in batches, from one background task per replica, so a Redis that is
slow or down never slows or fails the call it describes; an entry that cannot be
written is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import redis.asyncio as aioredis
from opentelemetry import trace
from prometheus_client import Counter

from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DEPENDENCY_ERRORS, DependencyOverloaded
from turnstile_platform.redis_client import read_script
from turnstile_platform.settings import DecisionLogSettings

log = logging.getLogger(__name__)

#: Every entry a writer appends carries these fields, in this order (empty when
#: they do not apply): one field list for every entry keeps the stream compact.
FIELDS = (
    "at",
    "service",
    "kind",
    "trace",
    "sampled",
    "identity",
    "client",
    "sandbox",
    "key",
    "activation",
    "node",
    "detail",
)

#: Entries waiting for the writer at most; more are dropped (and counted).
QUEUE_LIMIT = 10_000
#: Entries one script call appends at most.
BATCH = 200
#: How long closing waits for the queued entries to be written.
CLOSE_WAIT_S = 2.0

DROPPED = Counter(
    "turnstile_decision_log_dropped_total",
    "Decision-log entries of the substrate or affinity (their side of an Activate or a "
    "Place) not written: the queue was full, or Redis failed the write (SPEC Q3).",
    ["service", "why"],
)


#: The reserved bounded keys an entry may name as its client (the platform's
#: ``native``, ``unattributed``: :mod:`turnstile_clientkeys.resolver`), and the key
#: of every client without one of its own.
RESERVED_KEYS = frozenset({"native", "unattributed"})
SHARED_KEY = "shared"


def decisions_key(prefix: str) -> str:
    """The log's single stream before SPEC N3 (``<prefix>{adm}:decisions``): no
    longer written; read beside the new streams while its entries age out
    (``DecisionLogSettings.read_legacy``), and expired by itself after its age."""
    return f"{prefix}{{adm}}:decisions"


def key_stream(prefix: str, key: str) -> str:
    """One bounded key's stream (``<prefix>{adm}:decisions:k:<key>``)."""
    return f"{prefix}{{adm}}:decisions:k:{key}"


def platform_stream(prefix: str) -> str:
    """The platform's stream: entries charged to no client, and audit entries."""
    return f"{prefix}{{adm}}:decisions:platform"


def sandbox_stream(stream: str, sandbox_id: str) -> str:
    """The copy of ``stream``'s entries of one sandbox (``_decision_stream.lua``)."""
    return f"{stream}:sb:{sandbox_id}"


def streams_index(prefix: str) -> str:
    """Sorted set of the log's streams (key and platform streams, not sandbox
    streams) by when each was last trimmed: what an operator's read of every
    client merges and what the export's consumer groups are created on."""
    return f"{prefix}{{adm}}:decisions:streams"


def script_text(name: str) -> str:
    """A platform decision-log script with the shared append prepended (after its
    ``#!lua`` line, which must stay first)."""
    shebang, _, body = read_script("turnstile_platform", name).partition("\n")
    return "\n".join((shebang, read_script("turnstile_platform", "_decision_stream.lua"), body))


def bounds(settings: DecisionLogSettings) -> tuple[int, int, int, int]:
    """The four bounds every append passes (``_decision_stream.lua``)."""
    return (
        settings.max_entries,
        round(settings.max_age_s * 1000),
        settings.sandbox_max_entries,
        settings.max_sandboxes,
    )


def _targets(prefix: str, key: str, client: str) -> tuple[str, str]:
    """The stream an entry goes to, and the one it goes to if that does not exist.

    With its bounded key, that key's stream; a reserved key named as client, its
    stream; a client id alone (affinity knows no key set), the client's own key's
    stream if admission has logged one (it exists), else the shared key's; no
    client at all, the platform's."""
    if key:
        return key_stream(prefix, key), ""
    if client in RESERVED_KEYS:
        return key_stream(prefix, client), ""
    if client and client != SHARED_KEY:
        return key_stream(prefix, client), key_stream(prefix, SHARED_KEY)
    if client:
        return key_stream(prefix, SHARED_KEY), ""
    return platform_stream(prefix), ""


async def append_platform_entry(
    client: aioredis.Redis | aioredis.RedisCluster,
    prefix: str,
    settings: DecisionLogSettings,
    *,
    service: str,
    kind: str,
    identity: str = "",
    detail: str = "",
    key: str = "",
    extra: Mapping[str, str] | None = None,
) -> str:
    """Append one entry to the platform's stream now and return its id ("" with
    the log off): for what the platform itself does, such as an operator's change
    of limits or of the key set (``kind`` ``limits_changed``/``keys_changed``,
    ``identity`` who, ``detail`` what, ``key`` the key it is about; ``extra``:
    fields of the entry's kind after the common ones, e.g. the admin API's
    ``target``, ``verb``, ``previous`` and ``current``).

    Awaited, unlike :class:`DecisionLogWriter`: an audit entry is written with the
    change or the caller learns it failed (Redis errors propagate)."""
    if settings.max_entries <= 0:
        return ""
    context = trace.get_current_span().get_span_context()
    values = (
        str(int(time.time() * 1000)),
        service,
        kind,
        format(context.trace_id, "032x") if context.trace_id else "",
        "1" if context.trace_flags.sampled else "0",
        identity,
        "",
        "",
        key,
        "",
        "",
        detail,
    )
    fields = [*zip(FIELDS, values, strict=True), *(extra or {}).items()]
    args: list[Any] = [*bounds(settings), len(fields), platform_stream(prefix), "", ""]
    for name, value in fields:
        args += [name, value]
    script = client.register_script(script_text("decision_append.lua"))
    ids = await script(keys=[streams_index(prefix), platform_stream(prefix)], args=args)
    return _text_id(ids[0]) if ids else ""


def _text_id(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class DecisionLogWriter:
    """Appends one service's entries to the decision log from a background task.

    The task runs on every replica (each writes its own calls' entries), started
    by the first :meth:`append` and ended by :meth:`close`, which lets it write
    what is queued first (for at most :data:`CLOSE_WAIT_S`)."""

    def __init__(
        self,
        client: aioredis.Redis | aioredis.RedisCluster,
        prefix: str,
        settings: DecisionLogSettings,
        service: str,
    ) -> None:
        self._redis = client
        self._prefix = prefix
        self._keys = [streams_index(prefix), platform_stream(prefix)]
        self._service = service
        self._head = (*bounds(settings), len(FIELDS))
        self.enabled = settings.max_entries > 0
        self._script = client.register_script(script_text("decision_append.lua"))
        self._queue: asyncio.Queue[tuple[str, ...]] = asyncio.Queue(QUEUE_LIMIT)
        self._tasks = BackgroundTasks(f"decision-log-{service}")
        self._running = False

    def append(
        self,
        kind: str,
        *,
        sandbox_id: str = "",
        client: str = "",
        identity: str = "",
        key: str = "",
        activation: str = "",
        node: str = "",
        detail: str = "",
    ) -> None:
        """Queue one entry (returns at once); the trace id is the current span's.

        It goes to ``key``'s stream, or the stream ``client`` is logged under when
        no key is known (:func:`_targets`)."""
        if not self.enabled:
            return
        context = trace.get_current_span().get_span_context()
        values = (
            str(int(time.time() * 1000)),
            self._service,
            kind,
            format(context.trace_id, "032x") if context.trace_id else "",
            "1" if context.trace_flags.sampled else "0",
            identity,
            client,
            sandbox_id,
            key,
            activation,
            node,
            detail,
        )
        try:
            self._queue.put_nowait(values)
        except asyncio.QueueFull:
            DROPPED.labels(self._service, "queue_full").inc()
            return
        if not self._running:
            self._running = True
            # Restarted with backoff if a write fails other than by Redis (a bug).
            self._tasks.supervise(self._run, name=f"decision-log-{self._service}")

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._write(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    async def _write(self, batch: list[tuple[str, ...]]) -> None:
        args: list[Any] = list(self._head)
        for values in batch:
            client, sandbox, key = values[6], values[7], values[8]
            args += [*_targets(self._prefix, key, client), sandbox]
            for name, value in zip(FIELDS, values, strict=True):
                args += [name, value]
        try:
            await self._script(keys=self._keys, args=args)
        except (*DEPENDENCY_ERRORS, DependencyOverloaded) as error:
            DROPPED.labels(self._service, "redis").inc(len(batch))
            log.warning(
                "decision-log entries dropped: redis failed the write",
                extra={"entries": len(batch), "error": str(error)},
            )

    async def close(self) -> None:
        """Write what is queued (for at most :data:`CLOSE_WAIT_S`), then stop."""
        if self._running:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await self._queue.join()
        await self._tasks.close()
