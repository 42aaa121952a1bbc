"""When a worker tries the relay again: capped exponential backoff with full jitter.

After a relay replica dies (or drains, or ends its streams at their maximum age)
thousands of workers lose their streams in the same instant. Each waits a delay
drawn uniformly from ``[0, min(maximum, initial × 2**attempt))`` ("full jitter"):
the reconnects spread evenly over the window instead of arriving together, and
every failed attempt doubles the window, so a fleet facing a replica at its
stream limit backs away quickly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def reconnect_delays(initial_s: float, maximum_s: float, rng: random.Random) -> Iterator[float]:
    """The waits before each successive reconnect attempt (an endless schedule)."""
    window = min(initial_s, maximum_s)
    while True:
        yield rng.uniform(0.0, window)
        window = min(window * 2, maximum_s)
