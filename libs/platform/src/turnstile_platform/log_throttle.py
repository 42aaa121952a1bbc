"""Log lines an untrusted caller can multiply, throttled: a line per key per interval.

A refused call is cheap for its caller and a log line is not: 2,000 refused
Hellos wrote 2,000 lines in 5.6 s before this (SPEC O6). Every such line goes
through a :class:`LogThrottle`, keyed by who was refused and why (an identity
and a reason, or a method): the first line of a key is written, the next ones
within ``interval_s`` are only counted, and the key's next line says how many
it stood for ("and K more"; ``suppressed_since_last`` in the structured
fields). Metrics count every refusal; the log is for reading.

Memory is bounded: at most ``max_keys`` keys are tracked. A new key when the
table is full takes the place of the key logged longest ago if that key's
interval is over (its count, if any, is dropped: the metrics still have it),
and otherwise shares one overflow count (its line says
``throttle_overflow``), so the lines per interval stay at most
``max_keys + 1`` however many keys a caller makes up.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping


class LogThrottle:
    """At most one line per key per ``interval_s``; the lines in between counted."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 60.0,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        # Thread-safe: grpc may call a deserializer, and so a decoding warning,
        # off the event loop.
        self._lock = threading.Lock()
        # key -> [when last written, lines not written since]; oldest written first.
        self._keys: OrderedDict[Hashable, list[float]] = OrderedDict()
        self._overflow: list[float] = [-math.inf, 0]

    def warning(self, key: Hashable, message: str, extra: Mapping[str, object]) -> bool:
        """Write ``message`` at WARNING unless ``key`` had a line within the
        interval (then count it); True if written."""
        return self.log(logging.WARNING, key, message, extra)

    def log(
        self,
        level: int,
        key: Hashable,
        message: str,
        extra: Mapping[str, object],
        exc_info: BaseException | None = None,
    ) -> bool:
        """Write ``message`` at ``level`` (with ``exc_info``'s traceback) unless
        ``key`` had a line within the interval (then count it); True if written."""
        now = self._clock()
        with self._lock:
            state = self._state(key, now)
            if now - state[0] < self.interval_s:
                state[1] += 1
                return False
            suppressed = int(state[1])
            state[0], state[1] = now, 0
            if state is not self._overflow:
                self._keys.move_to_end(key)
        if suppressed:
            message = f"{message} (and {suppressed} more since the last such line)"
        fields = {**extra, "suppressed_since_last": suppressed}
        if state is self._overflow:
            fields["throttle_overflow"] = True
        self.logger.log(level, message, extra=fields, exc_info=exc_info)
        return True

    def _state(self, key: Hashable, now: float) -> list[float]:
        """``key``'s [last written, suppressed], new if untracked; the overflow's
        when the table is full of keys still within their interval."""
        state = self._keys.get(key)
        if state is not None:
            return state
        if len(self._keys) >= self._max_keys:
            oldest = next(iter(self._keys))
            if now - self._keys[oldest][0] < self.interval_s:
                return self._overflow
            del self._keys[oldest]
        state = self._keys[key] = [-math.inf, 0]
        return state

    def __len__(self) -> int:
        """How many keys are tracked (the overflow not counted)."""
        return len(self._keys)
