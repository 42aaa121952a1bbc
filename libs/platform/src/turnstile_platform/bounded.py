"""Bounded calls to a dependency: a per-call budget and a circuit breaker (SPEC F3).

Why one timer around the whole call: a per-socket timeout does not bound a call
(redis-py retries, reconnects and health-checks inside one command; asyncpg waits
for a pool connection, connects, then runs the statement), so :class:`Guard`
cancels the call's task when its budget is spent. Repeated failures open a
:class:`Breaker` per dependency (per node of a Redis Cluster, :class:`Source`),
which refuses calls at once until one probe succeeds.

Why a spent budget is judged before it fails the call: the budget counts our own
queueing too, and a fail mode applied to our own overload admits past a fail-open
cap. A budget spent while the dependency answered others, or while the event loop
stalled (:class:`_Stalls`), gets up to ``overload_wait_s`` more; only a budget the
loop had in full with no sign of life fails as unavailable and counts toward the
breaker, and a call still held up after the wait is overloaded, never a fail mode.
Callers see only the two exceptions of :mod:`turnstile_platform.dependencies`,
translated at the guarded call's exit (the client library's own retries inside the
call still see its own types).

The breaker is written here, not taken from a library: it counts only failures
that mean "unreachable", takes a caller's cancellation as neither success nor
failure, and reports into the health map and metrics. Details and measurements:
docs/operations.md, "When a dependency fails".
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Protocol

from prometheus_client import Counter, Gauge

from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import (
    DEPENDENCY_ERRORS,
    DependencyOverloaded,
    DependencyUnavailable,
)
from turnstile_platform.health import HealthMap
from turnstile_platform.metric_children import Children

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
NODE_BREAKER_STATE = Gauge(
    "turnstile_dependency_node_breaker_state",
    "Circuit breaker of each node of a dependency served by several (a Redis "
    "Cluster's masters): 0 closed, 1 half-open (one probe), 2 open. The "
    "dependency's own gauge shows the worst of its nodes' while they serve it.",
    ["dependency", "node"],
)
BREAKER_TRANSITIONS = Counter(
    "turnstile_dependency_breaker_transitions_total",
    "Circuit breaker state changes, by dependency and the state entered.",
    ["dependency", "state"],
)
CALLS = Counter(
    "turnstile_dependency_calls_total",
    "Bounded calls to a dependency by result: ok, error (the dependency answered "
    "with an error), timeout (a budget spent with no answer from the dependency to "
    "anyone), overloaded (still held up by this process's own overload after the "
    "overload wait: not counted by the breaker), unreachable (connection failed), "
    "rejected (breaker open).",
    ["dependency", "result"],
)
#: ``CALLS`` by (dependency, result), looked up without prometheus_client's lock:
#: every Redis and PostgreSQL call counts one.
_CALLS = Children(CALLS)
OVERLOAD_WAITS = Counter(
    "turnstile_dependency_overload_waits_total",
    "Calls that spent their budget while the dependency answered others (or the "
    "event loop stalled) and went on waiting instead of failing: this process's "
    "own overload, not the dependency's.",
    ["dependency"],
)


class BudgetExceededError(DependencyUnavailable):
    """The call's budget was spent with no sign of life from the dependency."""


class BreakerOpenError(DependencyUnavailable):
    """The dependency's breaker is open: the call was refused without trying."""


class Breaker:
    """Closed → open after ``failures`` consecutive failures → half-open after
    ``open_s`` (one probe call) → closed on the probe's success.

    A breaker of one node of a dependency (``node`` set) reports into
    ``turnstile_dependency_node_breaker_state``; the dependency's breaker reports
    the worst of its own state and its tracked members' (:meth:`track`) into
    ``turnstile_dependency_breaker_state``, to its listeners (health) and in its
    log lines. Not thread-safe; one event loop owns it, like the client it guards.
    """

    def __init__(
        self,
        dependency: str,
        *,
        failures: int = 3,
        open_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        node: str | None = None,
    ) -> None:
        self.dependency = dependency
        self.node = node
        self._threshold = failures
        self._open_s = open_s
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probing = False
        self._listeners: list[Callable[[BreakerState], None]] = []
        self._members: set[Breaker] = set()
        self._parent: Breaker | None = None
        #: The state last reported (gauge, listeners): the worst with the members'.
        self._reported = BreakerState.CLOSED
        self._gauge_set(BreakerState.CLOSED)

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose wait is over reads as half-open)."""
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._open_s:
            return BreakerState.HALF_OPEN
        return self._state

    @property
    def reported(self) -> BreakerState:
        """What the dependency reports: the worst of this breaker's state and its
        members' (as last entered: an open one stays open here until its probe)."""
        return self._reported

    def on_change(self, listener: Callable[[BreakerState], None]) -> None:
        """Call ``listener`` with the new reported state on every change of it."""
        self._listeners.append(listener)

    def track(self, members: Iterable[Breaker]) -> None:
        """Report the worst of this breaker's and ``members``' states from now on
        (the breakers of the nodes now serving the dependency), in place of the
        members tracked before: a node that stopped serving (a master replaced by
        its replica) no longer holds the dependency open."""
        wanted = set(members)
        for gone in self._members - wanted:
            gone._parent = None
            NODE_BREAKER_STATE.remove(gone.dependency, gone.node)
        for joined in wanted - self._members:
            joined._parent = self
            joined._gauge_set(joined._state)
        self._members = wanted
        self._report()

    def probe_now(self) -> None:
        """Let the next call be the probe now, instead of refusing calls for the
        rest of the open wait: something other than a call says the dependency is
        back (the sentinels named a new primary)."""
        if self._state is BreakerState.OPEN:
            self._opened_at = self._clock() - self._open_s

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
        self._report()

    def _report(self) -> None:
        state = max((self._state, *(member._state for member in self._members)))
        if state is self._reported:
            return
        self._reported = state
        self._gauge_set(state)
        name = state.name.lower()
        if self.node is None:
            BREAKER_TRANSITIONS.labels(self.dependency, name).inc()
            log.warning(
                "dependency breaker %s",
                name,
                extra={"dependency": self.dependency, "breaker": name},
            )
        else:
            log.warning(
                "dependency node breaker %s",
                name,
                extra={"dependency": self.dependency, "node": self.node, "breaker": name},
            )
        for listener in self._listeners:
            listener(state)
        if self._parent is not None:
            self._parent._report()

    def _gauge_set(self, state: BreakerState) -> None:
        if self.node is None:
            BREAKER_STATE.labels(self.dependency).set(int(state))
        elif self._parent is not None:
            NODE_BREAKER_STATE.labels(self.dependency, self.node).set(int(state))


class Source(Protocol):
    """Where a call's signs of life come from and which breaker counts it: a whole
    dependency (the :class:`Guard` itself) or one node of it."""

    @property
    def breaker(self) -> Breaker: ...

    def answered(self) -> None:
        """Record an answer from the source, now."""

    def answered_since(self, when: float) -> bool:
        """Whether the source answered anything after event-loop time ``when``."""
        ...


#: How long a call held up by this process's own overload may wait for its
#: answer, from its start, before it fails as overloaded (TURNSTILE_OVERLOAD_WAIT_S).
DEFAULT_OVERLOAD_WAIT_S = 10.0
#: The bounds of the stall heartbeat's period (a tenth of the guard's budget):
#: a stall is measured to within one period.
_MIN_BEAT_S = 0.005
_MAX_BEAT_S = 0.05
#: The shortest stall counted, as a share of the guard's budget: a busy loop's
#: turns (and the CPU scheduler's) are shorter, and leave a call turns enough in
#: its budget to send and read; a longer one may take the last of them.
_STALL_SHARE = 0.25


class Guard:
    """The budget and breaker of one dependency, applied to each call.

    ``unreachable`` lists the exceptions that count as the dependency failing
    (anything else it raises is an answer, and counts as success for the
    breaker); ``local`` lists failures of this process, not of the dependency
    (an exhausted client pool), which count as neither and are raised as
    :class:`~turnstile_platform.dependencies.DependencyOverloaded`.
    """

    def __init__(
        self,
        dependency: str,
        budget_s: float,
        *,
        unreachable: tuple[type[BaseException], ...],
        local: tuple[type[BaseException], ...] = (),
        failures: int = 3,
        open_s: float = 1.0,
        overload_wait_s: float = DEFAULT_OVERLOAD_WAIT_S,
    ) -> None:
        self.dependency = dependency
        self.budget_s = budget_s
        #: The longest a call waits on its answer while the dependency answers others.
        self.overload_wait_s = max(overload_wait_s, budget_s)
        self.breaker = Breaker(dependency, failures=failures, open_s=open_s)
        self._failures = failures
        self._open_s = open_s
        self._unreachable = unreachable
        self._local_errors = local
        #: Event-loop time of the latest answer (ok or error) from the dependency.
        self._answered_at = float("-inf")
        #: How long the event loop could not run while calls were in flight.
        self.stalls = _Stalls(
            min(max(budget_s / 10, _MIN_BEAT_S), _MAX_BEAT_S), budget_s * _STALL_SHARE
        )

    def check(self) -> None:
        """Raise at once if the breaker is open (without claiming the probe)."""
        if self.breaker.state is BreakerState.OPEN:
            _CALLS(self.dependency, "rejected").inc()
            raise BreakerOpenError(self.dependency, self._open_message(self.breaker))

    def answered_since(self, when: float) -> bool:
        """Whether the dependency answered anything after event-loop time ``when``."""
        return self._answered_at > when

    def answered(self) -> None:
        """Record a sign of life that is not a whole call: a client calls it when
        the dependency answers a step of one (each reply of a new connection's
        handshake), so a burst that starts by opening connections shows the
        dependency answering before any call of it completes."""
        self._answered_at = asyncio.get_running_loop().time()

    def node_breaker(self, node: str) -> Breaker:
        """A breaker for one node of the dependency, configured like its own; the
        client tracks it as a member of :attr:`breaker` while the node serves."""
        return Breaker(self.dependency, failures=self._failures, open_s=self._open_s, node=node)

    def call(self, budget_s: float | None = None, *, source: Source | None = None) -> _Call:
        """Run the block (``async with guard.call():``) as one call: refused at once
        while the breaker is open, cut off with ``budget_exceeded`` when a budget
        (``budget_s``, default the configured one) passes with no sign of life from
        the dependency, or with ``overloaded`` when it is still held up here after
        the overload wait.

        ``source`` (default: the whole dependency) is what the call's signs of
        life come from and whose breaker refuses and counts it: one node, for a
        call that one node of the dependency serves."""
        return _Call(
            self,
            self.budget_s if budget_s is None else budget_s,
            self if source is None else source,
        )

    def _expired(self, watch: _Watch, breaker: Breaker) -> BaseException:
        """Count a call its watch cut off; the error to raise."""
        waited = watch.waited()
        if watch.overloaded:
            breaker.abandon()
            _CALLS(self.dependency, "overloaded").inc()
            return DependencyOverloaded(
                self.dependency,
                f"{self.dependency} call did not complete within {waited:.3g}s: this "
                "process is overloaded (the dependency answered others meanwhile)",
            )
        breaker.failure()
        _CALLS(self.dependency, "timeout").inc()
        what = self.dependency if breaker.node is None else f"{self.dependency} node {breaker.node}"
        return BudgetExceededError(
            self.dependency,
            f"{what} did not answer within {watch.budget_s:g}s ({waited:.3g}s waited)",
        )

    def _unavailable(self, error: BaseException) -> DependencyUnavailable:
        """A failure that means "unreachable", as callers see it."""
        return DependencyUnavailable(
            self.dependency, f"{self.dependency} unreachable: {type(error).__name__}: {error}"
        )

    def _local(self, error: BaseException) -> DependencyOverloaded:
        """A failure of this process's own (an exhausted pool), as callers see it."""
        return DependencyOverloaded(
            self.dependency,
            f"{self.dependency} call not made: this process is overloaded "
            f"({type(error).__name__}: {error})",
        )

    def _open_message(self, breaker: Breaker) -> str:
        what = self.dependency if breaker.node is None else f"{self.dependency} node {breaker.node}"
        return f"{what} is unavailable (circuit breaker open); not tried"


class _Call:
    """One guarded call, as an async context manager written out rather than
    through ``contextlib.asynccontextmanager``: every Redis and PostgreSQL call
    enters one, and the generator-based manager cost a visible share of a
    decision's CPU (docs/performance.md). Steps: the source's breaker, then the
    call's :class:`_Watch` armed (its one timer is the budget; it cancels the
    call's task when it cuts the call off, as ``asyncio.timeout`` would), the
    watch disarmed on the way out, then the outcome judged.

    The watch is the call's only timer: an ``asyncio.timeout`` beside it scheduled
    and cancelled a second one per call for the same deadline (docs/performance.md)."""

    __slots__ = ("_breaker", "_budget_s", "_guard", "_source", "_watch")

    def __init__(self, guard: Guard, budget_s: float, source: Source) -> None:
        self._guard = guard
        self._budget_s = budget_s
        self._source = source
        self._breaker = source.breaker

    async def __aenter__(self) -> None:
        guard, breaker = self._guard, self._breaker
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a guarded call must run inside a task")
        if not breaker.acquire():
            _CALLS(guard.dependency, "rejected").inc()
            raise BreakerOpenError(guard.dependency, guard._open_message(breaker))
        watch = self._watch = _Watch(guard, self._source, task, self._budget_s)
        watch.arm()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        guard, breaker, watch = self._guard, self._breaker, self._watch
        watch.disarm()
        error = exc
        cut = watch.cut
        # As asyncio.timeout's exit: the cancellation the watch sent, and no one
        # else's, becomes the TimeoutError of a call cut off.
        if cut and watch.uncancel() and exc_type is asyncio.CancelledError:
            error = TimeoutError()
            error.__cause__ = exc
        if error is None:
            self._source.answered()
            breaker.success()
            _CALLS(guard.dependency, "ok").inc()
            return
        if isinstance(error, TimeoutError):
            if not cut:  # a timeout of the client's own
                breaker.failure()
                _CALLS(guard.dependency, "timeout").inc()
                raise guard._unavailable(error) from error
            raise guard._expired(watch, breaker) from error
        # From here ``error`` is the block's own exception, which goes on (None
        # returned) unless replaced by the one the guard raises.
        if isinstance(error, (asyncio.CancelledError, *DEPENDENCY_ERRORS)):
            breaker.abandon()  # a cancellation, or an inner call's own verdict
            return
        if isinstance(error, guard._local_errors):
            breaker.abandon()
            _CALLS(guard.dependency, "overloaded").inc()
            raise guard._local(error) from error
        if not isinstance(error, guard._unreachable):
            self._source.answered()
            breaker.success()
            _CALLS(guard.dependency, "error").inc()
            return
        if cut:
            # The client's own (socket) timeout fired with ours.
            raise guard._expired(watch, breaker) from error
        breaker.failure()
        _CALLS(guard.dependency, "unreachable").inc()
        raise guard._unavailable(error) from error


class _Stalls:
    """How long the event loop could not run, measured while calls are in flight.

    A heartbeat every ``beat_s``: a beat that fires at least ``stall_s`` late
    was held up by a turn of the loop that long (a big batch of work, a garbage
    collection, the CPU taken by other processes), and its lateness is added to
    :attr:`total`; shorter turns are a busy loop, not a stalled one. A call's
    budget counts only the time the loop could run (:class:`_Watch`): a reply
    is read, and a command sent, only in a turn of it. One timer for every call
    in flight, not one per call (a call only counts itself in and out), and
    only while there is one. Not thread-safe: one event loop owns it, like the
    guard.
    """

    __slots__ = ("_active", "_due", "_handle", "_loop", "beat_s", "stall_s", "total")

    def __init__(self, beat_s: float, stall_s: float) -> None:
        self.beat_s = beat_s
        self.stall_s = stall_s
        #: Seconds of stalls seen by the heartbeat so far (it only ever grows).
        self.total = 0.0
        self._active = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def enter(self, loop: asyncio.AbstractEventLoop, now: float) -> None:
        """A call is in flight on ``loop`` from ``now`` (loop time): beat while it is."""
        if loop is not self._loop:  # a guard used on another loop (a test's own)
            if self._handle is not None:
                self._handle.cancel()
            self._loop, self._handle, self._active = loop, None, 0
        self._active += 1
        if self._handle is None:
            self._due = now + self.beat_s
            self._handle = loop.call_at(self._due, self._beat)

    def leave(self) -> None:
        """A call that :meth:`enter` counted is over."""
        self._active -= 1

    def lost(self, now: float) -> float:
        """The stalls so far, as of ``now``: :attr:`total` and the one under way
        (the next beat overdue), which the beat adds when it fires."""
        late = now - self._due
        if self._handle is not None and late >= self.stall_s:
            return self.total + late
        return self.total

    def _beat(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        late = now - self._due
        if late >= self.stall_s:
            self.total += late
        if self._active <= 0:
            self._handle = None
            return
        self._due = now + self.beat_s
        self._handle = loop.call_at(self._due, self._beat)


class _Watch:
    """One call's budgets: at the end of each, judge whether it goes on waiting,
    and cut the call off (cancel its task) when it does not.

    The judgement runs one event-loop turn after the budget's end, so an answer
    that arrived in the same turn as the expiry is recorded first (by this call,
    which then completes, or by another, which counts as a sign of life); the
    cut-off one turn after the judgement, as ``asyncio.timeout`` rescheduled to
    "now" did. A budget counts only the time the loop could run
    (:class:`_Stalls`): one that ends with part of it lost to stalls and no sign
    of life is not spent yet, and runs on for the part lost.
    """

    __slots__ = (
        "_cancelling",
        "_due",
        "_extended",
        "_handle",
        "_limit",
        "_loop",
        "_lost_at",
        "_stalls",
        "_task",
        "_window",
        "budget_s",
        "cut",
        "guard",
        "overloaded",
        "source",
        "started",
    )

    def __init__(
        self, guard: Guard, source: Source, task: asyncio.Task[object], budget_s: float
    ) -> None:
        self.guard = guard
        self.source = source
        self.budget_s = budget_s
        self._task = task
        self._cancelling = task.cancelling()
        self._loop = loop = task.get_loop()
        self.started = loop.time()
        #: Start of the budget being spent now: answers after it are signs of life.
        self._window = self.started
        self._due = self.started + budget_s
        self._limit = self.started + guard.overload_wait_s
        self._stalls = guard.stalls
        #: The loop's stalls when the budget being spent now began.
        self._lost_at = 0.0
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._extended = False
        #: Set when the watch cut the call off (cancelled its task).
        self.cut = False
        #: Set when the watch cut the call off because of our own overload.
        self.overloaded = False

    def arm(self) -> None:
        stalls = self._stalls
        stalls.enter(self._loop, self.started)
        self._lost_at = stalls.lost(self.started)
        self._handle = self._loop.call_at(self._due, self._budget_spent)

    def disarm(self) -> None:
        """Called once, as the call ends (armed or not: :meth:`arm` is always called)."""
        self._stalls.leave()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def uncancel(self) -> bool:
        """Take back the cancellation the cut-off sent; whether no other is pending
        (then the call's CancelledError is the cut-off's)."""
        return self._task.uncancel() <= self._cancelling

    def waited(self) -> float:
        return self._loop.time() - self.started

    def _budget_spent(self) -> None:
        self._handle = self._loop.call_soon(self._judge, self._loop.time())

    def _judge(self, fired_at: float) -> None:
        self._handle = None
        now = self._loop.time()
        answered = self.source.answered_since(self._window)
        # The part of the budget the loop could run, to send and read in.
        lost = self._stalls.lost(now) - self._lost_at
        had = now - self._window - lost
        if not answered and had >= self.budget_s:
            self._cut_off_soon()  # silent for a whole budget: the dependency
            return
        if now >= self._limit:
            self.overloaded = True
            self._cut_off_soon()
            return
        if not self._extended:
            self._extended = True
            OVERLOAD_WAITS.labels(self.guard.dependency).inc()
            log.debug(
                "dependency call outlived its budget under local overload; waiting on",
                extra={
                    "dependency": self.guard.dependency,
                    "answered_meanwhile": answered,
                    "expiry_late_s": round(fired_at - self._due, 3),
                    "stalled_s": round(lost, 3),
                },
            )
        if answered:  # a fresh budget, judged by the signs of life from now
            self._window = now
            self._lost_at = self._stalls.lost(now)
            self._due = now + self.budget_s
        else:  # the same budget, for the part the stalls took
            self._due = now + self.budget_s - max(had, 0.0)
        self._handle = self._loop.call_at(self._due, self._budget_spent)

    def _cut_off_soon(self) -> None:
        self._handle = self._loop.call_soon(self._cut_off)

    def _cut_off(self) -> None:
        self._handle = None
        self.cut = True
        self._task.cancel()


def report_breaker(health: HealthMap, component: str, breaker: Breaker) -> None:
    """Mark ``component`` unhealthy the moment ``breaker`` opens and healthy when
    it closes, without waiting for the next health check."""
    reports = BackgroundTasks(f"{component} breaker health")

    def changed(state: BreakerState) -> None:
        if state is BreakerState.HALF_OPEN:
            return
        reports.spawn(health.set(component, state is BreakerState.CLOSED), name="breaker health")

    breaker.on_change(changed)
