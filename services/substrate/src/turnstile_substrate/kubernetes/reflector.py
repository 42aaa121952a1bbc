"""The reflector: a list-then-watch cache of sandbox pods (SPEC S3).

One loop, the shape client-go's reflector has: **list** every matching pod, page by
page, and install the result whole into the :class:`PodIndex` (the list is the truth
at its resourceVersion, so what happened unwatched is reconciled by replacement, not
by diffing); **watch** from that version with bookmarks (so a quiet watch does not
fall behind compaction); when the watch ends cleanly, watch again from the newest
version seen; when it fails (``410 Gone``, a broken connection, any error),
**re-list**, backing off exponentially except after a 410. kubernetes-asyncio's
``Watch`` is not used: it raises on 410 and builds a ``V1Pod`` per event; the stream
is read as raw JSON lines (:mod:`turnstile_substrate.kubernetes.api`).

``synced`` is set once the first list is installed (until then counts are unknown
and the substrate is not ready); ``current`` only while the cache follows a watch
from a list, and the live publisher withdraws its counts while it is not. During a
re-list the cache keeps serving counts: a brief gap SPEC P6 accepts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from turnstile_platform.background import BackgroundTasks
from turnstile_substrate.kubernetes import metrics
from turnstile_substrate.kubernetes.api import KubeApiError, PodsApi
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.podinfo import PodInfo
from turnstile_substrate.kubernetes.settings import KubernetesSettings

log = logging.getLogger(__name__)

#: A watch that ends cleanly sooner than this is treated as suspicious and backed off,
#: so a server that ends every watch at once cannot spin the loop.
_MIN_CLEAN_WATCH_S = 1.0

_EVENT_COUNTERS = {
    kind: metrics.REFLECTOR_EVENTS.labels(type=kind)
    for kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")
}


class Reflector:
    """Keeps a :class:`PodIndex` equal to the API server's pods matching a selector."""

    def __init__(self, api: PodsApi, index: PodIndex, settings: KubernetesSettings) -> None:
        self._api = api
        self.index = index
        self._selector = settings.label_selector
        self._page_size = settings.list_page_size
        self._backoff_s = settings.relist_backoff_s
        self._backoff_max_s = settings.relist_backoff_max_s
        self.synced = asyncio.Event()
        #: newest resourceVersion applied to the index
        self.resource_version = ""
        self.lists = 0
        #: watch events applied (bookmarks included)
        self.events = 0
        # Runs on every replica: each serves reads from its own cache.
        self._running = BackgroundTasks("kubernetes reflector")
        self._progress = asyncio.Event()
        self._waiting = 0
        #: True while the cache follows the API server (listed, and watching since)
        self.current = False
        #: called whenever ``current`` changes
        self.on_current_change: Callable[[], None] | None = None

    def start(self) -> None:
        if not self._running:
            self._running.spawn(self._run(), name="k8s-reflector")

    async def stop(self) -> None:
        self._set_current(False)
        await self._running.close()

    async def wait_synced(self, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            await self.synced.wait()

    async def wait_until(self, condition: Callable[[], bool], timeout: float | None = None) -> None:
        """Wait until ``condition()`` holds, checked after each list and watch event
        (e.g. "the cache has reached resourceVersion N")."""
        self._waiting += 1
        try:
            async with asyncio.timeout(timeout):
                while True:
                    progress = self._progress
                    if condition():
                        return
                    await progress.wait()
        finally:
            self._waiting -= 1

    def _advanced(self) -> None:
        if self._waiting:
            progress, self._progress = self._progress, asyncio.Event()
            progress.set()

    async def _run(self) -> None:
        backoff = self._backoff_s
        gone_in_a_row = 0
        while True:
            events_at_list = self.events
            try:
                await self.relist()
                events_at_list = self.events
                backoff = self._backoff_s
                await self._watch_until_failure()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self._set_current(False)
                gone = isinstance(error, KubeApiError) and error.gone
                # a watch that made progress since the last list resets the streak
                progressed = self.events > events_at_list
                gone_in_a_row = (1 if progressed else gone_in_a_row + 1) if gone else 0
                immediate = gone_in_a_row == 1  # a server repeating 410 gets the backoff
                _log_failure(error, gone, 0.0 if immediate else backoff)
                if immediate:
                    continue
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._backoff_max_s)

    def _set_current(self, current: bool) -> None:
        if current != self.current:
            self.current = current
            if self.on_current_change is not None:
                self.on_current_change()

    async def _watch_until_failure(self) -> None:
        """Watch, and watch again from the last version each time a watch ends cleanly."""
        backoff = self._backoff_s
        while True:
            started = time.monotonic()
            await self._watch_once()
            metrics.REFLECTOR_WATCHES.labels(end="clean").inc()
            if time.monotonic() - started < _MIN_CLEAN_WATCH_S:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._backoff_max_s)
            else:
                backoff = self._backoff_s

    async def relist(self) -> None:
        """List every pod and install the result whole; the watch resumes from its version."""
        started = time.perf_counter()
        pods: list[PodInfo] = []
        page = await self._api.list_page(self._selector, self._page_size)
        version = page.resource_version
        pods.extend(page.pods)
        while page.continue_token:
            page = await self._api.list_page(self._selector, self._page_size, page.continue_token)
            pods.extend(page.pods)
        self.index.replace(pods)
        self.resource_version = version
        self.lists += 1
        self.synced.set()
        self._set_current(True)
        self._advanced()
        metrics.REFLECTOR_PODS.set(len(self.index))
        metrics.REFLECTOR_LIST_SECONDS.observe(time.perf_counter() - started)
        log.info("reflector: listed %d pods at resourceVersion %s", len(pods), version or "(none)")

    async def _watch_once(self) -> None:
        """Apply one watch's events; return when it ends cleanly, raise when it fails."""
        index = self.index
        stream = self._api.watch(self._selector, self.resource_version)
        async with contextlib.aclosing(stream):
            async for event in stream:
                pod = event.pod
                if pod is not None:
                    if event.type == "DELETED":
                        index.delete(pod.name)
                    else:
                        index.upsert(pod)
                if event.resource_version:
                    self.resource_version = event.resource_version
                counter = _EVENT_COUNTERS.get(event.type)
                if counter is not None:
                    counter.inc()
                self.events += 1
                self._advanced()
        metrics.REFLECTOR_PODS.set(len(index))


def _log_failure(error: Exception, gone: bool, delay: float) -> None:
    if gone:
        metrics.REFLECTOR_RELISTS.labels(reason="gone").inc()
        log.info("reflector: resourceVersion expired; re-listing in %.1fs", delay)
    elif isinstance(error, KubeApiError):
        metrics.REFLECTOR_RELISTS.labels(reason="error").inc()
        log.warning("reflector: API error %s; re-listing in %.1fs", error, delay)
    else:  # a cut connection, a read timeout, a malformed line
        metrics.REFLECTOR_RELISTS.labels(reason="disconnect").inc()
        log.warning(
            "reflector: watch or list failed (%s: %s); re-listing in %.1fs",
            type(error).__name__,
            error,
            delay,
        )
