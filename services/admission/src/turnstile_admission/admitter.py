"""The admission domain: resolve the client, run the one decision script, and turn
its answer into a :class:`Decision`.

A decision is exactly one script (``admit.lua``) and no other network call: the
cap's live count is read inside it, from the live sets the substrate's leader
keeps in Redis (SPEC S4, :mod:`turnstile_clientkeys.live_counts`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from opentelemetry import trace
from prometheus_client import Counter, Histogram

from turnstile_admission import decision_log, metrics
from turnstile_admission.decision import Decision
from turnstile_admission.decision_log import Page, Query
from turnstile_admission.fair_queue import FairQueue, waiter_of
from turnstile_admission.orphans import OrphanedHolds
from turnstile_admission.policies import (
    ActivationShape,
    CapPolicy,
    ConcurrencyPolicy,
    Kind,
    Policy,
    PolicyName,
    PolicyVerdict,
    RatePolicy,
    RawResult,
    ShadowVerdict,
    SlotsPolicy,
    Verdict,
)
from turnstile_admission.redis_store import (
    NOT_EVALUATED,
    UNSUPPORTED_DETAIL,
    AdmissionStore,
    AdmitAnswer,
    AdmitArgs,
    CancelAnswer,
    CommitAnswer,
    LogContext,
    OwnLimits,
    Queued,
    QueuePosition,
)
from turnstile_admission.settings import AdmissionSettings
from turnstile_admission.warm_reservations import WarmReservations
from turnstile_clientkeys import NATIVE, UNATTRIBUTED, BoundedKey, Client, KeyKind, Resolver
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable

log = logging.getLogger(__name__)


class AdmitInput(NamedTuple):
    """A validated Admit request (a named tuple: immutable, and built per Admit at
    half a frozen dataclass's cost)."""

    sandbox_id: str
    client: Client
    kind: Kind
    tier: str = ""
    candidate_nodes: tuple[str, ...] = ()
    #: How long the call may wait in the fair queue (0: answer at once).
    wait_s: float = 0.0
    #: With ``wait_s``: wait too when only the client's own limits refuse.
    queue_per_client: bool = False
    dry_run: bool = False
    """Decide and report, take nothing (SPEC Q4)."""
    identity: str = ""
    """The caller's SPIFFE ID, for the decision log (empty without authentication)."""
    wait_id: str = ""
    """The caller's id of this call, by which GetQueuePosition finds it waiting."""


@dataclass(frozen=True)
class Usage:
    key: BoundedKey
    live: int | None
    #: Why ``live`` is None: ``unsupported`` or ``unavailable`` ("" when known).
    live_unknown: str
    pending: int
    cap: int
    client_tokens: float
    client_capacity: float
    cluster_tokens: float
    cluster_capacity: float
    in_flight: int
    concurrency_limit: int
    node_slots_held: dict[str, int]


class _Plan:
    """What the policies make of an activation's shape (its kind, and whether
    candidate nodes were given): each policy's script mode, whether it applies,
    and its SKIPPED verdict. Nothing else of an activation matters to them, so
    this is worked out once per shape (the skip reasons are formatted strings),
    not per decision. Compared by identity: one per shape per admitter."""

    __slots__ = ("activation", "modes", "skipped", "steps")

    def __init__(self, policies: Sequence[Policy], activation: ActivationShape) -> None:
        #: The activation's kind as the decision log writes it.
        self.activation = activation.kind.value
        self.modes = {p.name: p.script_mode(activation) for p in policies}
        self.skipped = tuple(p.skipped(activation) for p in policies)
        #: Per policy in order: the policy, whether it applies, its SKIPPED verdict.
        self.steps = tuple(
            (p, p.evaluated(activation), skipped)
            for p, skipped in zip(policies, self.skipped, strict=True)
        )


class _Shape:
    """What every decision of one shape (``Decision.shape``) shares: the metric
    children it moves and, when it admits, its message. Compared by identity:
    the admitter keeps one per shape."""

    __slots__ = ("counters", "histogram", "message")

    def __init__(
        self, counters: tuple[Counter, ...], histogram: Histogram, message: str | None
    ) -> None:
        self.counters = counters
        self.histogram = histogram
        self.message = message


class Admitter:
    """Admit, commit, cancel, release and usage, over one store and one resolver."""

    def __init__(
        self,
        settings: AdmissionSettings,
        store: AdmissionStore,
        resolver: Resolver,
    ) -> None:
        self.settings = settings
        self.store = store
        self.resolver = resolver
        self.cap = CapPolicy(settings.cap)
        #: In evaluation order: see docs/admission.md for why.
        self.policies: tuple[Policy, ...] = (
            SlotsPolicy(settings.slots),
            ConcurrencyPolicy(settings.concurrency),
            self.cap,
            RatePolicy(settings.rate),
        )
        self._slots = settings.slots
        self.orphans = OrphanedHolds(store, settings.hold_ttl_s)
        #: The warm-pool refill's reservations (SPEC W3).
        self.warm = WarmReservations(settings, store, self.orphans)
        self.queue = FairQueue(store, settings)
        self._plans: dict[tuple[Kind, bool], _Plan] = {}
        #: Per decision shape, what its decisions share (``Decision.shape``).
        self._shapes: dict[tuple[object, ...], _Shape] = {}
        self._logging = settings.decision_log.max_entries > 0
        #: Per bounded key, its kind and key-set version as the log writes them.
        self._key_words: dict[BoundedKey, tuple[str, str]] = {}

    def _plan(self, kind: Kind, nodes: tuple[str, ...]) -> _Plan:
        shape = (kind, bool(nodes))
        plan = self._plans.get(shape)
        if plan is None:
            plan = self._plans[shape] = _Plan(self.policies, ActivationShape(kind, nodes))
        return plan

    async def admit(self, request: AdmitInput) -> Decision:
        started = time.perf_counter()
        key = self.resolver.resolve(request.client)
        # Looked up once: the decision log and the span attributes both need it.
        span = trace.get_current_span()
        # A dry run never waits: it decides at once and joins no queue (SPEC Q4).
        waits = (
            request.wait_s > 0
            and not request.dry_run
            and self.queue.enabled
            and min(request.wait_s, self.settings.queue.max_wait_s) > 0
        )
        # A call that may wait defers the log entry of a refusal the queue can
        # wait out: its decision is logged once, when it is final (SPEC Q1, Q3).
        own = waits and request.queue_per_client
        decision = await self._decide(request, key, span, defer=waits, defer_own=own)
        if waits and not decision.admitted and _queueable(decision, own):
            decision = await self._wait(request, key, decision, span)
        elif request.wait_s > 0 and self.queue.enabled and _would_queue(decision):
            decision = await self._would_wait(key, decision)
        if not decision.dry_run:
            # A dry run changes nothing, the metrics of decisions included.
            self._record(decision, time.perf_counter() - started, span)
        return decision

    async def _wait(
        self, request: AdmitInput, key: BoundedKey, refused: Decision, span: trace.Span
    ) -> Decision:
        """Wait in the fair queue for the cluster bucket or a node slot (whichever
        alone refused), or, asked to, for the client's own limits, then decide on
        the grant (SPEC Q1). Refused when the budget ends first (the first
        refusal, its retry hint with it), or when the grant's decision refuses
        on what the call does not wait for."""
        # ``admit`` sends only a call with a budget left here (queue enabled).
        budget = min(request.wait_s, self.settings.queue.max_wait_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        per_client = request.queue_per_client
        waiting = metrics.queue_key_waiters(key.key)
        waiting.inc()
        try:
            decision, joined = await self._wait_turns(request, key, span, refused, started, budget)
        finally:
            waiting.dec()
        granted = decision.admitted
        if not decision.admitted and _queueable(decision, per_client):
            # Its wait ended on a refusal the log has not seen: the final
            # decision, logged (SPEC Q3), outside the queue like any other call.
            decision = await self._decide(request, key, span, waited_s=loop.time() - started)
        waited = loop.time() - started
        outcome = "admitted" if decision.admitted else "refused"
        level = joined.level if joined is not None else ""
        metrics.queue_wait_seconds(level, outcome).observe(waited)
        metrics.queue_key_wait_seconds(key.key).observe(waited)
        if granted:
            metrics.queue_grants(key.key).inc()
        estimate = None
        if joined is not None and joined.queued and joined.estimated_wait_ms >= 0:
            estimate = joined.estimated_wait_ms / 1000
        message = decision.message
        if not decision.admitted:
            message += _unqueued(joined) or f"; waited {waited:.3f}s in the fair queue"
        return decision._replace(
            waited_s=waited,
            queue_position=joined.position if joined is not None else 0,
            estimated_wait_s=estimate,
            message=message,
        )

    async def _wait_turns(
        self,
        request: AdmitInput,
        key: BoundedKey,
        span: trace.Span,
        refused: Decision,
        started: float,
        budget: float,
    ) -> tuple[Decision, Queued | None]:
        """Join, wait for a grant and claim it, until admitted, refused on what
        the call does not wait for, or out of ``budget``: the last decision, and
        the first join's answer (None: it never joined)."""
        loop = asyncio.get_running_loop()
        deadline = started + budget
        decision, joined = refused, None
        per_client = request.queue_per_client
        resource = _queueable(refused, per_client)
        while (remaining := deadline - loop.time()) > 0:
            nodes = self._candidates(request) if resource == _SLOTS else ()
            own = self._own_limits(request) if resource == _OWN else None
            waiter = waiter_of(request.client, request.wait_id) if request.wait_id else ""
            wait = await self.queue.wait(key.key, remaining, nodes, own, waiter)
            if joined is None:
                joined = wait.queued
            if not wait.granted:
                break
            claimed = await self._decide(
                request,
                key,
                span,
                claim=wait.waiter,
                defer=True,
                defer_own=per_client,
                waited_s=loop.time() - started,
            )
            if claimed is _LOST:
                continue  # swept before it claimed: join again
            decision = claimed
            resource = _queueable(decision, per_client)
            if decision.admitted or not resource:
                break
        return decision, joined

    async def _would_wait(self, key: BoundedKey, decision: Decision) -> Decision:
        """Report where the call would have joined the fair queue, joining nothing
        (SPEC Q1, Q4): a dry run, or a call a shadow mode let through. Without
        Redis, the decision as it is."""
        try:
            peek = await self.store.peek(key.key)
        except (DependencyUnavailable, DependencyOverloaded):
            return decision
        if not decision.dry_run:
            metrics.QUEUE_SHADOW.labels(peek.level).inc()
        estimate = peek.estimated_wait_ms / 1000 if peek.estimated_wait_ms >= 0 else None
        said = f", estimated {estimate:.3f}s" if estimate is not None else ""
        return decision._replace(
            queue_position=peek.position,
            estimated_wait_s=estimate,
            message=f"{decision.message}; would have waited in the fair queue "
            f"at position {peek.position}{said}",
        )

    def _candidates(self, request: AdmitInput) -> list[tuple[str, int]]:
        """The request's candidate nodes with their slots, in its order."""
        return [(n, self._slots.capacity(n)) for n in request.candidate_nodes]

    def _own_limits(self, request: AdmitInput) -> OwnLimits:
        """Which of the client's own limits the call enforces: those its grant
        waits for room under (SPEC Q1)."""
        modes = self._plan(request.kind, request.candidate_nodes).modes
        return OwnLimits(
            cap=modes[PolicyName.CAP] == _ENFORCE,
            concurrency=modes[PolicyName.CONCURRENCY] == _ENFORCE,
            rate=modes[PolicyName.RATE] == _ENFORCE,
        )

    def _log_context(
        self,
        request: AdmitInput,
        key: BoundedKey,
        span: trace.Span,
        plan: _Plan,
        waited_s: float | None,
    ) -> LogContext | None:
        """What the decision log records beside the script's own (SPEC Q3); None
        when the log is off or nothing is logged (a dry run). A few microseconds
        per decision: what depends on the key alone is formatted once per key."""
        if request.dry_run or not self._logging:
            return None
        context = span.get_span_context()
        trace_id = context.trace_id
        client = request.client
        words = self._key_words.get(key)
        if words is None:
            # Bounded like the shapes: by the keys (SPEC C3) and their versions.
            if len(self._key_words) >= _MAX_KEY_WORDS:
                self._key_words.clear()
            words = self._key_words[key] = (key.kind.value, str(key.version) if key.version else "")
        return LogContext(
            f"{trace_id:032x}" if trace_id else "",
            bool(context.trace_flags & 1),
            request.identity,
            client.client_id if client.client_id is not None else client.form.value,
            words[0],
            words[1],
            plan.activation,
            "" if waited_s is None else str(round(waited_s * 1000)),
        )

    async def _decide(
        self,
        request: AdmitInput,
        key: BoundedKey,
        span: trace.Span,
        claim: str = "",
        defer: bool = False,
        defer_own: bool = False,
        waited_s: float | None = None,
    ) -> Decision:
        plan = self._plan(request.kind, request.candidate_nodes)
        modes = plan.modes
        nodes: Sequence[tuple[str, int]] = ()
        if modes[PolicyName.SLOTS]:
            nodes = self._candidates(request)
        args = AdmitArgs(
            hold_id=new_hold_id(),
            key=key.key,
            sandbox_id=request.sandbox_id,
            modes=modes,
            nodes=nodes,
            dry_run=request.dry_run,
            log=self._log_context(request, key, span, plan, waited_s),
            defer=defer,
            defer_own=defer_own,
        )
        # The one place admission decides on a failing Redis: fail modes apply
        # to an unavailable Redis only. Anything else (a script error) is a bug.
        try:
            answer = await self.store.admit(args, claim)
        except (DependencyOverloaded, asyncio.CancelledError):
            # Not an outage, so no fail mode: this replica could not keep up
            # (or the caller gave up). Nothing was decided for the caller (the
            # interceptor sheds the call: UNAVAILABLE, REPLICA_OVERLOADED), but
            # the script may have run: its hold has no owner, so cancel it. The
            # cancel leaves a tombstone, so a script still on its way to Redis
            # takes nothing when it gets there.
            if not request.dry_run:
                self.orphans.cancel(args.hold_id)
            raise
        except DependencyUnavailable as error:
            return self._unreachable(request, key, plan, args.hold_id, error)
        if answer.outcome == "cancelled":
            return self._cancelled(key, plan)
        if request.dry_run:
            return self._from_answer(key, plan, "", answer, dry_run=True)
        if answer.outcome == "lost":
            return _LOST
        if modes[PolicyName.CAP]:
            metrics.pending(key.key).set(answer.pending_count)
        if answer.pending_expired:
            metrics.PENDING_EXPIRED.labels(key.key).inc(answer.pending_expired)
        return self._from_answer(key, plan, args.hold_id, answer)

    def _from_answer(
        self,
        key: BoundedKey,
        plan: _Plan,
        hold_id: str,
        answer: AdmitAnswer,
        *,
        dry_run: bool = False,
    ) -> Decision:
        verdicts = []
        results = answer.results
        for policy, evaluated, skipped in plan.steps:
            # A policy that does not apply was not evaluated by the script either.
            raw = results[policy.name] if evaluated else NOT_EVALUATED
            if raw.code == RawResult.NOT_EVALUATED:
                verdicts.append(skipped)
                continue
            if policy is self.cap and raw.code == RawResult.UNKNOWN:
                raw = RawResult(raw.code, raw.limit, raw.current, raw.retry_ms, answer.live.detail)
            verdicts.append(policy.evaluated_verdict(raw))
        admitted = answer.outcome == "admit"
        shadow = (
            tuple(
                ShadowVerdict(policy, result.over, result.limit, result.current)
                for policy, result in answer.shadow.items()
            )
            if answer.shadow
            else ()
        )
        shape = self._shape(key, admitted, plan, verdicts, shadow, dry_run)
        message = shape.message or _message(admitted, key, verdicts)
        if dry_run:
            message = f"dry run: {message} (nothing was taken)"
        return Decision(
            admitted,
            key,
            tuple(verdicts),
            hold_id if admitted else "",
            answer.hold_expires_ms,
            answer.node,
            message,
            shape,
            dry_run,
            shadow,
        )

    def _shape(
        self,
        key: BoundedKey,
        admitted: bool,
        plan: _Plan,
        verdicts: Sequence[PolicyVerdict],
        shadow: Sequence[ShadowVerdict] = (),
        dry_run: bool = False,
    ) -> _Shape:
        """What decisions of this one's shape share: the decision's ``shape``.

        The shape is the key, the outcome, the activation's plan (which fixes each
        policy's mode and skip reason) and each verdict (an unknown one with its
        fail-open backend): everything the decision's metrics, its admitted
        message and the fixed part of its response depend on, and nothing per
        call (no limit, count, hold or time); with the shadow limits' verdicts
        and whether it is a dry run. Shapes are bounded by the keys (SPEC C3)
        times the policies' verdicts, so what they share is made once per shape
        (docs/performance.md)."""
        key_shape: tuple[object, ...] = (
            key.key,
            key.kind,
            admitted,
            plan,
            *[
                (v.verdict, _fail_open_backend(v)) if v.verdict is Verdict.UNKNOWN else v.verdict
                for v in verdicts
            ],
            dry_run,
            *[(s.policy, s.over) for s in shadow],
        )
        shared = self._shapes.get(key_shape)
        if shared is None:
            counters, histogram = self._shape_record(key, admitted, verdicts, shadow)
            message = _message(True, key, verdicts) if admitted else None
            shared = self._shapes[key_shape] = _Shape(counters, histogram, message)
        return shared

    def _cancelled(self, key: BoundedKey, plan: _Plan) -> Decision:
        """The hold was cancelled before the script ran: nothing was evaluated or
        taken, nothing is admitted. The cancel runs only once a caller has given up
        on the decision, so this answer reaches no one in practice."""
        verdicts = plan.skipped
        return Decision(
            admitted=False,
            key=key,
            verdicts=verdicts,
            hold_id="",
            hold_expires_ms=0,
            message=f"refused for key {key.key}: the decision's hold was cancelled before "
            "it was taken; retry",
            shape=self._shape(key, False, plan, verdicts),
        )

    def _unreachable(
        self,
        request: AdmitInput,
        key: BoundedKey,
        plan: _Plan,
        hold_id: str,
        error: BaseException,
    ) -> Decision:
        """Each policy answers by its fail mode; admitted means no hold was recorded.

        The decision log is in the Redis that cannot be reached, so this decision
        is not in it (SPEC Q3): it is a log line (its trace id, key, sandbox and
        verdicts) and ``turnstile_admission_decisions_unlogged_total``."""
        activation = ActivationShape(request.kind, request.candidate_nodes)
        verdicts = [p.unreachable(activation, "redis unreachable") for p in self.policies]
        admitted = not any(v.refuses for v in verdicts)
        outcome = "fail_open" if admitted else "fail_closed"
        if not request.dry_run:
            metrics.UNLOGGED.labels(outcome).inc()
        log.warning(
            "redis unreachable during admit: decided by the fail modes, not in the decision log",
            extra={
                "key": key.key,
                "sandbox": request.sandbox_id,
                "decision": outcome,
                "dry_run": request.dry_run,
                "verdicts": ",".join(f"{v.policy.value}={v.verdict.value}" for v in verdicts),
                "error": str(error),
            },
        )
        if request.dry_run:
            shape = self._shape(key, admitted, plan, verdicts, (), True)
            return Decision(
                admitted,
                key,
                tuple(verdicts),
                message=f"dry run: {shape.message or _message(admitted, key, verdicts)} "
                "(redis unreachable: the fail modes decided)",
                shape=shape,
                dry_run=True,
            )
        expires = int(time.time() * 1000 + self.settings.hold_ttl_s * 1000) if admitted else 0
        shape = self._shape(key, admitted, plan, verdicts)
        message = shape.message or _message(admitted, key, verdicts)
        if admitted:
            message += " (redis unreachable: commit or cancel the hold as usual)"
        else:
            # The script may have run and only its reply been lost: no caller
            # will settle a refused hold, so cancel it once Redis answers.
            self.orphans.cancel(hold_id)
        return Decision(
            admitted=admitted,
            key=key,
            verdicts=tuple(verdicts),
            hold_id=hold_id if admitted else "",
            hold_expires_ms=expires,
            message=message,
            shape=shape,
        )

    def _record(self, decision: Decision, seconds: float, span: trace.Span) -> None:
        # The counters a decision moves depend only on its shape (the key, the
        # outcome and each policy's verdict), so they were looked up once per
        # shape (``_shape``), not label by label per call (docs/performance.md).
        # Every decision ``_decide`` returns has its shape.
        shape = decision.shape
        assert isinstance(shape, _Shape)
        for counter in shape.counters:
            counter.inc()
        shape.histogram.observe(seconds)
        if span.is_recording():
            key = decision.key.key
            outcome = "admitted" if decision.admitted else "refused"
            refused = decision.refused_by
            span.set_attributes(
                {
                    "turnstile.key": key,
                    "turnstile.key_kind": decision.key.kind.value,
                    "turnstile.key_set_version": decision.key.version,
                    "turnstile.admission.decision": outcome,
                    "turnstile.admission.refused_by": refused.policy.value if refused else "",
                    "turnstile.admission.node": decision.node,
                    **{
                        f"turnstile.admission.verdict.{v.policy.value}": v.verdict.value
                        for v in decision.verdicts
                    },
                }
            )

    @staticmethod
    def _shape_record(
        bounded: BoundedKey,
        admitted: bool,
        verdicts: Sequence[PolicyVerdict],
        shadow: Sequence[ShadowVerdict] = (),
    ) -> tuple[tuple[Counter, ...], Histogram]:
        """The counters one decision of this shape moves, and its histogram."""
        key = bounded.key
        outcome = "admitted" if admitted else "refused"
        refused = next((v for v in verdicts if v.verdict is Verdict.REFUSE), None)
        counters: list[Counter] = [
            metrics.decisions(outcome, refused.policy.value if refused else "", key)
        ]
        for v in verdicts:
            counters.append(metrics.verdicts(v.policy.value, v.verdict.value, key))
            if v.verdict is Verdict.SHADOW_REFUSE:
                counters.append(metrics.shadow_refusals(v.policy.value, key))
            elif v.verdict is Verdict.UNKNOWN:
                counters.append(metrics.fail_open(v.policy.value, _fail_open_backend(v), key))
        # A shadow limit reached counts as the shadow mode's would-be refusals do
        # (SPEC Q4), whatever the enforced policies decided.
        counters.extend(metrics.shadow_refusals(s.policy.value, key) for s in shadow if s.over)
        return tuple(counters), metrics.decision_seconds(outcome)

    async def commit(self, hold_id: str, prepaid: bool = False) -> CommitAnswer:
        """Commit a hold; ``prepaid``: its runtime is a warm pod ``ReserveWarm`` paid
        for, so its cluster tokens go back (SPEC W3)."""
        answer = await self.store.commit_answer(hold_id, prepaid)
        metrics.holds("commit", "done" if answer.committed else "gone").inc()
        return answer

    async def cancel(self, hold_id: str) -> CancelAnswer:
        answer = await self.store.cancel(hold_id)
        metrics.holds("cancel", "done" if answer.cancelled else "gone").inc()
        return answer

    async def release(self, sandbox_id: str) -> bool:
        return await self.store.release(sandbox_id)

    async def decisions(self, query: Query) -> Page:
        """A page of the decision log (SPEC Q3, N3), newest first: a client's from its
        bounded key's stream alone, every client's (an operator's) merged from the
        streams the log's index lists."""
        prefix, log = self.store.keys.prefix, self.settings.decision_log
        if query.client:
            key = self.resolver.resolve(_log_client(query.client))
            sources = decision_log.client_sources(prefix, log, query, key)
        else:
            streams = await self.store.decision_streams(decision_log.MAX_STREAMS)
            sources = decision_log.all_sources(prefix, log, query, streams)
        return await decision_log.read(self.store.redis, sources, query)

    async def queue_position(self, client: Client, wait_id: str) -> QueuePosition:
        """Where ``client``'s call carrying ``wait_id`` stands in the fair queue."""
        return await self.store.queue_position(waiter_of(client, wait_id))

    async def usage(self, client: Client) -> Usage:
        key = self.resolver.resolve(client)
        answer = await self.store.usage(key.key)
        if answer.pending_expired:
            metrics.PENDING_EXPIRED.labels(key.key).inc(answer.pending_expired)
        return Usage(
            key=key,
            live=answer.live.live,
            live_unknown=""
            if answer.live.live is not None
            else ("unsupported" if answer.live.unsupported else "unavailable"),
            pending=len(answer.pending_ids),
            cap=answer.cap,
            client_tokens=answer.client_tokens,
            client_capacity=answer.client_capacity,
            cluster_tokens=answer.cluster_tokens,
            cluster_capacity=answer.cluster_capacity,
            in_flight=answer.in_flight,
            concurrency_limit=answer.concurrency_limit,
            node_slots_held=answer.node_slots_held,
        )


#: A claim whose grant was gone (``claim.lua``'s ``lost``): nothing was decided.
_LOST = Decision(False, BoundedKey("", KeyKind.UNATTRIBUTED, 0), ())

#: The refusals the fair queue can wait out, each a shared resource (SPEC Q1):
#: the cluster bucket's, and node slots'.
_CLUSTER_BUCKET = "cluster bucket"
_SLOTS = "slots"
_OWN = "own"
#: The script mode of an enforced policy (``Policy.script_mode``).
_ENFORCE = 2


def _own(verdict: PolicyVerdict) -> bool:
    """A refusal by one of the client's own limits, counted by the script (not a
    fail mode's)."""
    if verdict.policy is PolicyName.RATE:
        return verdict.detail == _CLIENT_BUCKET
    return verdict.policy in (PolicyName.CAP, PolicyName.CONCURRENCY) and not (
        verdict.detail.startswith("POLICY_BACKEND_UNAVAILABLE")
    )


_CLIENT_BUCKET = "client bucket"
#: A slots refusal's details when the script counted the nodes full (not a fail
#: mode's): none, or the free slots kept for the nodes' waiters.
_SLOTS_FULL = frozenset({"", "waiters first"})


def _log_client(client_id: str) -> Client:
    """The client a ListDecisions ``client_id`` names (a reserved key's name, or an id)."""
    if client_id == NATIVE:
        return Client.native()
    if client_id == UNATTRIBUTED:
        return Client.unattributed()
    return Client.of(client_id)


def _queueable(decision: Decision, per_client: bool = False) -> str:
    """What the queue waits for: the one shared resource that alone refused
    (``cluster bucket`` or ``slots``), or with ``per_client`` the client's own
    limits when only they refused (``own``: its cap, concurrency, bucket); ""
    otherwise (nothing refused, or a mix: answered at once). ``admit.lua``
    defers the log entry of exactly these refusals."""
    refusing = [v for v in decision.verdicts if v.verdict is Verdict.REFUSE]
    if per_client and refusing and all(_own(v) for v in refusing):
        return _OWN
    if len(refusing) != 1:
        return ""
    (verdict,) = refusing
    if verdict.policy is PolicyName.SLOTS and verdict.detail in _SLOTS_FULL:
        return _SLOTS
    if verdict.policy is PolicyName.RATE and verdict.detail == _CLUSTER_BUCKET:
        return _CLUSTER_BUCKET
    return ""


def _only_cluster_bucket(decision: Decision, verdict: Verdict) -> bool:
    """Whether only the cluster bucket gave ``verdict`` (a refusal, or a shadow
    refusal): the queue that peek.lua reports on."""
    refusing = [v for v in decision.verdicts if v.verdict is verdict]
    return bool(refusing) and all(
        v.policy is PolicyName.RATE and v.detail == _CLUSTER_BUCKET for v in refusing
    )


def _unqueued(joined: Queued | None) -> str:
    """Why a call that asked to wait never joined the fair queue ("": it joined, or
    Redis could not be asked)."""
    if joined is None or joined.queued:
        return ""
    if joined.key_full:
        return (
            f"; the fair queue was full for its key ({joined.waiters} of its calls waiting, "
            "the most one key may)"
        )
    return f"; the fair queue was full ({joined.waiters} waiting)"


def _would_queue(decision: Decision) -> bool:
    """A call with a wait budget the queue would have kept but did not: a dry run
    only the cluster bucket refused, or a call the rate policy's shadow mode let
    through that only the cluster bucket would have refused (SPEC Q1, Q4)."""
    if decision.dry_run:
        return not decision.admitted and _only_cluster_bucket(decision, Verdict.REFUSE)
    return decision.admitted and _only_cluster_bucket(decision, Verdict.SHADOW_REFUSE)


#: Bounded keys whose words ``_log_context`` keeps (more: it starts over).
_MAX_KEY_WORDS = 4096


def new_hold_id() -> str:
    """128 random bits as 32 hex digits (a version-4 UUID's ``hex`` without the
    ``UUID`` object, which cost a visible share of an Admit)."""
    return os.urandom(16).hex()


def _fail_open_backend(verdict: PolicyVerdict) -> str:
    """The ``backend`` label of a decision made without a verdict.

    ``unsupported``: the substrate cannot count at all (Direct, SPEC S4), so the
    cap answers UNKNOWN on every decision by design; an operator must be able to
    tell that apart from a real outage (``redis``), which
    ``TurnstileAdmissionFailingOpen`` alerts on.
    """
    if verdict.detail == UNSUPPORTED_DETAIL:
        return "unsupported"
    return "redis"


def _message(admitted: bool, key: BoundedKey, verdicts: Sequence[PolicyVerdict]) -> str:
    if admitted:
        shadow = [v.policy.value for v in verdicts if v.verdict is Verdict.SHADOW_REFUSE]
        note = f"; shadow refusals: {', '.join(shadow)}" if shadow else ""
        return f"admitted for key {key.key}{note}"
    refused = next(v for v in verdicts if v.verdict is Verdict.REFUSE)
    detail = f" ({refused.detail})" if refused.detail else ""
    text = (
        f"refused by {refused.policy.value} for key {key.key}: "
        f"{refused.current} of {refused.limit}{detail}"
    )
    if refused.policy is PolicyName.CAP and _own(refused):
        # A cap frees when a sandbox stops, not after a time: its RetryInfo is only
        # how soon asking again is worth it.
        text += f"; frees when one of its {refused.current} live or pending sandboxes stops"
    return text
