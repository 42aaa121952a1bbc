"""A warning logged once per key per interval, with a count of the ones it stood for.

Untrusted workers choose what they send, so a line per offending message would
let one of them fill the logs: each key (a sandbox and a reason) gets one line
per interval, and that line says how many more happened since the last one.
The memory is bounded: past :data:`MAX_KEYS` keys the oldest is forgotten
(its next occurrence is logged at once, which is the safe side).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

#: Keys remembered at most.
MAX_KEYS = 10_000


class ThrottledLog:
    """``warn(key, message, extra)``: logged at most once per ``interval_s`` per key."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        #: key → (when it was last logged, occurrences since then)
        self._seen: OrderedDict[tuple[str, ...], tuple[float, int]] = OrderedDict()

    def warn(self, key: tuple[str, ...], message: str, extra: Mapping[str, Any]) -> bool:
        """Log ``message`` unless ``key`` was logged within the interval; True if logged."""
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._interval_s:
            self._seen[key] = (seen[0], seen[1] + 1)
            return False
        suppressed = seen[1] if seen is not None else 0
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        if len(self._seen) > MAX_KEYS:
            self._seen.popitem(last=False)
        self._log.warning(message, extra={**extra, "suppressed_since_last": suppressed})
        return True
