"""The decision log's shared parts (SPEC Q3): its key, its bounds, and the writer the
substrate and affinity append their side of a call with.

The log is one Redis stream in admission's hash slot, ``<prefix>{adm}:decisions``.
Admission's decision script appends each ``Admit`` decision itself, atomically with
it. The substrate (``Activate``: its outcome and why) and affinity (``Place``: hit,
first, fallback with the reset, pending, busy) add their entries for the same
trace through :class:`DecisionLogWriter`: off the call path, in batches, from one
background task per replica, so a Redis that is slow or down never slows or fails
the call it describes; an entry that cannot be written is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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


def decisions_key(prefix: str) -> str:
    """The decision log, in admission's hash slot (``<prefix>{adm}:decisions``)."""
    return f"{prefix}{{adm}}:decisions"


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
        self._key = decisions_key(prefix)
        self._service = service
        self._head = (settings.max_entries, round(settings.max_age_s * 1000), len(FIELDS))
        self.enabled = settings.max_entries > 0
        self._script = client.register_script(
            read_script("turnstile_platform", "decision_append.lua")
        )
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
        """Queue one entry (returns at once); the trace id is the current span's."""
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
            for name, value in zip(FIELDS, values, strict=True):
                args += [name, value]
        try:
            await self._script(keys=[self._key], args=args)
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
