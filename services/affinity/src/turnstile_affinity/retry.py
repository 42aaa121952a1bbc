"""Retry hints of Place's refusals (SPEC T9)."""

from __future__ import annotations

import math

#: A pending session is told to come back after at most this long, so a sandbox
#: that returns early is noticed quickly.
MAX_PENDING_RETRY_S = 10
MIN_PENDING_RETRY_S = 1


def pending_retry_after_s(remaining_grace_ms: float, default_s: float) -> float:
    """``min(10, max(1, ceil(remaining_grace_ms / 1000)))`` seconds.

    Proportional to the grace left, so a client honouring it does not poll a
    60 s grace a dozen times. A non-finite value falls back to ``default_s``, the
    hint every other retryable refusal uses.
    """
    if not math.isfinite(remaining_grace_ms):
        return default_s
    seconds = math.ceil(remaining_grace_ms / 1000)
    return float(min(MAX_PENDING_RETRY_S, max(MIN_PENDING_RETRY_S, seconds)))
