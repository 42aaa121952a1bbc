"""Serving one watch: filter the subscription's events and stream newline-delimited JSON.

Wire format is the API server's ``application/json`` watch stream: one ``{"type": ...,
"object": ...}`` per line. Selector semantics follow the watch cache's ``cacheWatcher``: an update
that makes an object start matching is sent as ADDED, one that makes it stop matching as DELETED
(carrying the previous content stamped with the event's version), and an update or delete of an
object that matched neither before nor after is not sent at all.

BOOKMARKs carry only ``metadata.resourceVersion`` on an otherwise empty Pod. Their version is
always one whose events this stream has fully delivered, so a client that resumes from a bookmark
never skips or repeats an event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from turnstile_testing.kube_emulator.errors import ApiError
from turnstile_testing.kube_emulator.store import (
    ADDED,
    DELETED,
    MODIFIED,
    Control,
    Event,
    PodStore,
    Subscription,
    encode,
)

_PREFIX = {
    ADDED: b'{"type":"ADDED","object":',
    MODIFIED: b'{"type":"MODIFIED","object":',
    DELETED: b'{"type":"DELETED","object":',
}
_SUFFIX = b"}\n"


def event_line(kind: str, raw_object: bytes) -> bytes:
    """One watch-stream line."""
    return _PREFIX[kind] + raw_object + _SUFFIX


def bookmark_line(resource_version: int, *, initial_events_end: bool = False) -> bytes:
    """A BOOKMARK line; ``initial_events_end`` adds the annotation ``sendInitialEvents`` expects."""
    metadata: dict[str, object] = {"resourceVersion": str(resource_version)}
    if initial_events_end:
        metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
    obj = {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": metadata,
        "spec": {"containers": None},
        "status": {},
    }
    return b'{"type":"BOOKMARK","object":' + encode(obj) + _SUFFIX


def error_line(error: ApiError) -> bytes:
    """An ERROR line carrying a ``Status`` (how a watch reports 410 Expired)."""
    return b'{"type":"ERROR","object":' + encode(error.status()) + _SUFFIX


def convert(event: Event, sub: Subscription) -> bytes | None:
    """Translate a committed write into what this watcher should see, if anything."""
    flt = sub.filter
    if flt.everything and flt.namespace is None:
        return event_line(event.type, event.pod.raw)
    now_matches = event.type != DELETED and flt.matches(event.pod.obj)
    was_matching = event.prev is not None and flt.matches(event.prev.obj)
    if now_matches:
        return event_line(MODIFIED if was_matching else ADDED, event.pod.raw)
    if not was_matching:
        return None
    if event.type == DELETED:
        return event_line(DELETED, event.pod.raw)
    assert event.prev is not None
    return event_line(DELETED, event.prev.restamped(event.rv).raw)


@dataclass(frozen=True, slots=True)
class WatchOptions:
    """What the request asked for, parsed."""

    bookmarks: bool = False
    bookmark_interval: float = 60.0
    timeout: float | None = None
    initial_events_end_bookmark: bool = False


Sender = Callable[[bytes], Awaitable[None]]


class WatchStream:
    """Drives one subscription until timeout, a graceful end, or a cut.

    ``send`` writes bytes to the HTTP response; it is a parameter so the loop stays independent
    of aiohttp.
    """

    def __init__(self, store: PodStore, sub: Subscription, options: WatchOptions) -> None:
        self.store = store
        self.sub = sub
        self.options = options

    async def run(self, send: Sender) -> str | None:
        """Stream until done; return :attr:`Control.CUT` if the stream must be cut abruptly."""
        opts = self.options
        loop = asyncio.get_running_loop()
        deadline = None if opts.timeout is None else loop.time() + opts.timeout
        next_bookmark = loop.time() + opts.bookmark_interval
        queue = self.sub.queue
        if opts.initial_events_end_bookmark:
            # The replay is already queued: send it, then the bookmark that closes it.
            chunk, control = self._drain()
            await send(chunk + bookmark_line(self._safe_rv(), initial_events_end=True))
            if control is not None:
                return control if control == Control.CUT else None
        while True:
            now = loop.time()
            if deadline is not None and now >= deadline:
                return None
            if queue.empty():
                wait = next_bookmark - now if opts.bookmarks else None
                if deadline is not None:
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                try:
                    async with asyncio.timeout(wait):
                        first = await queue.get()
                except TimeoutError:
                    if opts.bookmarks and loop.time() >= next_bookmark:
                        await send(bookmark_line(self._safe_rv()))
                        next_bookmark = loop.time() + opts.bookmark_interval
                    continue
                chunk, control = self._drain(first)
            else:
                chunk, control = self._drain()
            if chunk:
                await send(chunk)
            if control is not None:
                return control if control == Control.CUT else None

    def _drain(self, first: Event | str | None = None) -> tuple[bytes, str | None]:
        """Encode everything queued (after ``first``) up to a control message, as one chunk.

        Batching matters at high event rates: one socket write per burst instead of per event.
        """
        queue = self.sub.queue
        sub = self.sub
        parts: list[bytes] = []
        item = first
        while True:
            if item is None:
                if queue.empty():
                    return b"".join(parts), None
                item = queue.get_nowait()
            if isinstance(item, str):
                return b"".join(parts), item
            if item.synthetic or item.rv > sub.start_rv:
                line = convert(item, sub)
                if line is not None:
                    parts.append(line)
            if item.rv > sub.consumed_rv:
                sub.consumed_rv = item.rv
            item = None

    def _safe_rv(self) -> int:
        """A version whose events this stream has all delivered."""
        if self.sub.queue.empty():
            self.sub.consumed_rv = max(self.sub.consumed_rv, self.store.resource_version)
        return self.sub.consumed_rv
