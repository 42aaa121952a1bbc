"""How a periodic pass (a sweep, a refill) reports that it failed.

A dependency outage (PostgreSQL or Redis unavailable or this replica overloaded,
:mod:`turnstile_platform.dependencies`; the Kubernetes API's socket refused) fails
every pass until it ends, and the next pass retries by itself: one
warning line each, not a traceback every few seconds that buries the log. Anything
else is a bug worth its traceback.
"""

from __future__ import annotations

import logging

from turnstile_platform.dependencies import DEPENDENCY_ERRORS


def log_failed_pass(log: logging.Logger, what: str, error: Exception) -> None:
    """Log ``what`` failed: a warning line for an outage, a traceback otherwise."""
    if isinstance(error, (*DEPENDENCY_ERRORS, OSError)):
        log.warning("%s failed (%s: %s); the next pass retries", what, type(error).__name__, error)
    else:
        log.error("%s failed", what, exc_info=error)
