"""How a periodic pass (a sweep, a refill) reports that it failed.

A dependency outage (PostgreSQL or Redis unreachable, its breaker open, a budget
spent) fails every pass until it ends, and the next pass retries by itself: one
warning line each, not a traceback every few seconds that buries the log. Anything
else is a bug worth its traceback.
"""

from __future__ import annotations

import logging

from turnstile_platform.bounded import DependencyUnavailableError
from turnstile_platform.postgres import is_unavailable


def log_failed_pass(log: logging.Logger, what: str, error: Exception) -> None:
    """Log ``what`` failed: a warning line for an outage, a traceback otherwise."""
    if is_unavailable(error) or isinstance(error, DependencyUnavailableError):
        log.warning("%s failed (%s: %s); the next pass retries", what, type(error).__name__, error)
    else:
        log.error("%s failed", what, exc_info=error)
