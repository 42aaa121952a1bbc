"""Bounded calls to a dependency: a per-call budget and a circuit breaker (SPEC F3).

A hung dependency (a paused Redis or PostgreSQL, a black-holed network) must cost
a call no more than its configured timeout. A per-socket timeout does not give
that: redis-py retries, reconnects and sends health-check PINGs inside one
command, each with its own socket timeout, and asyncpg may wait for a pool
connection, connect, then run the statement. So the budget here wraps the whole
call — pool wait, reconnects, retries, health checks — in one ``asyncio.timeout``.

Repeated failures (a budget spent, a refused or dropped connection) open a
breaker per dependency: while it is open every call fails at once, so each
policy applies its fail mode immediately instead of spending its budget again.
After ``open_s`` the breaker half-opens and lets exactly one call through as a
probe; its success closes the breaker, its failure opens it again (the
resilience4j state machine). Health and metrics report the state.

The budget counts everything the caller waits for, our own event loop and
connection pool included, but the breaker must open only when the *dependency*
stops answering, never because this process is overloaded (a burst of
thousands of streams reattaching at once). So a spent budget counts as a
dependency failure only when the dependency gave no sign of life meanwhile:
when another call to it got an answer after this one began, the dependency was
answering and this call's time went to queueing here (the event loop, the
pool); and when the expiry itself fired a whole budget late, the event loop
was stalled and the call never had its budget. Either way the call still fails
with ``budget_exceeded`` (its caller applies its fail mode), but the breaker is
left as it was and the metrics say ``overloaded``. A paused server answers
nobody, so its calls' timeouts still count and open the breaker.

The errors raised are chosen by the caller (:class:`Guard` takes the classes),
so each client can raise what its existing handlers already treat as
"dependency unavailable": a redis-py ``TimeoutError``/``ConnectionError``
subclass for Redis, a builtin ``TimeoutError``/``ConnectionError`` for
PostgreSQL. Both bases are builtins too, so a handler written for either
catches them.

The breaker is small and written here rather than taken from a library: it
must count only the failures that mean "unreachable" (never a script error or
a constraint violation), treat a caller's cancellation as neither success nor
failure, and report into the platform's health map and metrics.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from prometheus_client import Counter, Gauge

from turnstile_platform.health import HealthMap

log = logging.getLogger(__name__)


class BreakerState(enum.IntEnum):
    """Exported as the value of ``turnstile_dependency_breaker_state``."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


BREAKER_STATE = Gauge(
    "turnstile_dependency_breaker_state",
    "Circuit breaker of each dependency: 0 closed, 1 half-open (one probe), 2 open.",
    ["dependency"],
)
BREAKER_TRANSITIONS = Counter(
    "turnstile_dependency_breaker_transitions_total",
    "Circuit breaker state changes, by dependency and the state entered.",
    ["dependency", "state"],
)
CALLS = Counter(
    "turnstile_dependency_calls_total",
    "Bounded calls to a dependency by result: ok, error (the dependency answered "
    "with an error), timeout (budget spent, the dependency silent), overloaded "
    "(budget spent while the dependency answered other calls, or the event loop "
    "stalled: local overload, not counted by the breaker), unreachable "
    "(connection failed), rejected (breaker open).",
    ["dependency", "result"],
)


class DependencyUnavailableError(ConnectionError):
    """A call was not made, or not answered, because the dependency is unavailable."""

    def __init__(self, dependency: str, message: str) -> None:
        super().__init__(message)
        self.dependency = dependency

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else self.dependency


class BudgetExceededError(DependencyUnavailableError, TimeoutError):
    """The call's budget was spent before the dependency answered."""


class BreakerOpenError(DependencyUnavailableError):
    """The dependency's breaker is open: the call was refused without trying."""


class Breaker:
    """Closed → open after ``failures`` consecutive failures → half-open after
    ``open_s`` (one probe call) → closed on the probe's success.

    Not thread-safe; one event loop owns it, like the client it guards.
    """

    def __init__(
        self,
        dependency: str,
        *,
        failures: int = 3,
        open_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dependency = dependency
        self._threshold = failures
        self._open_s = open_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self._listeners: list[Callable[[BreakerState], None]] = []
        BREAKER_STATE.labels(dependency).set(0)

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose wait is over reads as half-open)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._open_s:
            return BreakerState.HALF_OPEN
        return self._state

    def on_change(self, listener: Callable[[BreakerState], None]) -> None:
        """Call ``listener`` with the new state on every transition."""
        self._listeners.append(listener)

    def acquire(self) -> bool:
        """Whether a call may go ahead now; True makes it the probe when half-open.

        A caller given True must report with :meth:`success`, :meth:`failure`
        or :meth:`abandon`.
        """
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probing:
            self._probing = True
            self._enter(BreakerState.HALF_OPEN)
            return True
        return False

    def success(self) -> None:
        self._consecutive = 0
        self._probing = False
        if self._state is not BreakerState.CLOSED:
            self._enter(BreakerState.CLOSED)

    def failure(self) -> None:
        self._consecutive += 1
        was_probe = self._probing
        self._probing = False
        if was_probe or (
            self._state is BreakerState.CLOSED and self._consecutive >= self._threshold
        ):
            self._opened_at = self._clock()
            self._enter(BreakerState.OPEN)

    def abandon(self) -> None:
        """The call ended without telling anything (cancelled by its caller)."""
        self._probing = False

    def _enter(self, state: BreakerState) -> None:
        if state is self._state:
            return
        self._state = state
        BREAKER_STATE.labels(self.dependency).set(int(state))
        BREAKER_TRANSITIONS.labels(self.dependency, state.name.lower()).inc()
        log.warning(
            "dependency breaker %s",
            state.name.lower(),
            extra={"dependency": self.dependency, "breaker": state.name.lower()},
        )
        for listener in self._listeners:
            listener(state)


ErrorFactory = Callable[[str, str], BaseException]


class Guard:
    """The budget and breaker of one dependency, applied to each call.

    ``unreachable`` lists the exceptions that count as the dependency failing
    (anything else it raises is an answer, and counts as success for the
    breaker); ``local`` lists failures of this process, not of the dependency
    (an exhausted client pool), which count as neither. ``budget_exceeded``
    and ``breaker_open`` build the exceptions raised when the budget is spent
    or the breaker refuses the call.
    """

    def __init__(
        self,
        dependency: str,
        budget_s: float,
        *,
        unreachable: tuple[type[BaseException], ...],
        local: tuple[type[BaseException], ...] = (),
        budget_exceeded: ErrorFactory = BudgetExceededError,
        breaker_open: ErrorFactory = BreakerOpenError,
        failures: int = 3,
        open_s: float = 1.0,
    ) -> None:
        self.dependency = dependency
        self.budget_s = budget_s
        self.breaker = Breaker(dependency, failures=failures, open_s=open_s)
        self._unreachable = unreachable
        self._local = local
        #: Event-loop time of the latest answer (ok or error) from the dependency.
        self._answered_at = float("-inf")
        self._budget_exceeded = budget_exceeded
        self._breaker_open = breaker_open

    def check(self) -> None:
        """Raise at once if the breaker is open (without claiming the probe)."""
        if self.breaker.state is BreakerState.OPEN:
            CALLS.labels(self.dependency, "rejected").inc()
            raise self._breaker_open(self.dependency, self._open_message())

    @asynccontextmanager
    async def call(self, budget_s: float | None = None) -> AsyncIterator[None]:
        """Run the block as one call: refused at once while the breaker is open,
        cut off with ``budget_exceeded`` when ``budget_s`` (default: the
        configured budget) is spent."""
        if not self.breaker.acquire():
            CALLS.labels(self.dependency, "rejected").inc()
            raise self._breaker_open(self.dependency, self._open_message())
        budget = self.budget_s if budget_s is None else budget_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        timeout = asyncio.timeout(budget)
        try:
            async with timeout:
                yield
        except TimeoutError as error:
            if not timeout.expired():
                self.breaker.failure()
                CALLS.labels(self.dependency, "timeout").inc()
                raise
            raise await self._spent(started, budget, loop.time()) from error
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except BaseException as error:
            if isinstance(error, self._local):
                self.breaker.abandon()
                raise
            if not isinstance(error, self._unreachable):
                self._answered_at = loop.time()
                self.breaker.success()
                CALLS.labels(self.dependency, "error").inc()
                raise
            if timeout.expired():
                # The client's own (socket) timeout fired with ours: the budget is spent.
                raise await self._spent(started, budget, loop.time()) from error

            self.breaker.failure()
            CALLS.labels(self.dependency, "unreachable").inc()
            raise
        self._answered_at = loop.time()
        self.breaker.success()
        CALLS.labels(self.dependency, "ok").inc()

    async def _spent(self, started: float, budget: float, now: float) -> BaseException:
        """Count a spent budget (or not, under local overload); the error to raise.

        Waits one turn of the event loop first: an answer that arrived in the same
        turn as the expiry is recorded by its own call, which the loop resumes
        after this one's cancellation.
        """
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        if self._overloaded(started, budget, now):
            self.breaker.abandon()
            CALLS.labels(self.dependency, "overloaded").inc()
            message = (
                f"{self.dependency} call did not complete within {budget:g}s "
                "(local overload: not counted by the breaker)"
            )
        else:
            self.breaker.failure()
            CALLS.labels(self.dependency, "timeout").inc()
            message = f"{self.dependency} did not answer within {budget:g}s"
        return self._budget_exceeded(self.dependency, message)

    def _overloaded(self, started: float, budget: float, now: float) -> bool:
        """Whether a call that spent its budget was held up here, not by the dependency.

        The dependency answered another call after this one began (so it was
        answering; this call waited on our event loop or pool), or the expiry ran
        a whole budget late (the event loop was stalled past the deadline).
        """
        answered_meanwhile = self._answered_at > started
        stalled = now - (started + budget) >= budget
        if answered_meanwhile or stalled:
            log.debug(
                "dependency call timed out under local overload; breaker not counting it",
                extra={
                    "dependency": self.dependency,
                    "answered_meanwhile": answered_meanwhile,
                    "expiry_late_s": round(now - started - budget, 3),
                },
            )
            return True
        return False

    def _open_message(self) -> str:
        return f"{self.dependency} is unavailable (circuit breaker open); not tried"


def report_breaker(health: HealthMap, component: str, breaker: Breaker) -> None:
    """Mark ``component`` unhealthy the moment ``breaker`` opens and healthy when
    it closes, without waiting for the next health check."""
    pending: set[asyncio.Task[None]] = set()

    def changed(state: BreakerState) -> None:
        if state is BreakerState.HALF_OPEN:
            return
        task = asyncio.get_running_loop().create_task(
            health.set(component, state is BreakerState.CLOSED)
        )
        pending.add(task)
        task.add_done_callback(pending.discard)

    breaker.on_change(changed)
