"""What a failing dependency looks like to its callers: exactly two exceptions.

The platform's Redis and PostgreSQL clients raise only these to code outside
the platform (never a bare ``OSError``, a ``TimeoutError`` or a library's own
error type), translated at the exit of each guarded call
(:mod:`turnstile_platform.bounded`), where redis-py and asyncpg have already
done their own retries and topology refreshes on their own types.

* :class:`DependencyUnavailable`: the dependency did not answer, refused the
  connection, its breaker is open, or it answered that it cannot serve now (a
  read-only standby, a shutting-down server). A policy may apply its fail mode.
* :class:`DependencyOverloaded`: *this replica* could not get the call done in
  time (its budget spent while the dependency answered others, its pool
  exhausted). Nothing about the dependency is known, so no fail mode applies:
  the call is refused retryably.

The two are unrelated on purpose (neither subclasses the other, nor ``OSError``):
a handler that catches "unavailable" to fail open cannot catch an overload by
accident. The platform interceptor answers both (``UNAVAILABLE`` with
``DEPENDENCY_UNAVAILABLE`` or ``REPLICA_OVERLOADED``, see
:func:`turnstile_platform.errors.dependency_error`), so handlers need not
catch them at all unless they decide something (admission's fail modes).
"""

from __future__ import annotations


class DependencyUnavailable(Exception):  # noqa: N818 - the name says what callers catch
    """``dependency`` (``"redis"``, ``"postgresql"``) cannot serve the call now."""

    def __init__(self, dependency: str, message: str) -> None:
        super().__init__(message)
        self.dependency = dependency

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.dependency


class DependencyOverloaded(Exception):  # noqa: N818 - the name says what callers catch
    """This replica could not complete its call to ``dependency`` in time: its own
    overload, not the dependency's failure. Never a reason for a fail mode."""

    def __init__(self, dependency: str, message: str) -> None:
        super().__init__(message)
        self.dependency = dependency

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.dependency


DependencyError = DependencyUnavailable | DependencyOverloaded
#: Both, for an ``except`` clause that handles either alike (a periodic pass).
DEPENDENCY_ERRORS = (DependencyUnavailable, DependencyOverloaded)
