"""Activate and Deactivate, written once against the ``Substrate`` interface.

The path of one activation (DESIGN "The path of one wake"):

1. A runtime that already runs answers ALREADY_RUNNING at once, without the
   sandbox lock and without asking admission (SPEC S5: never refused).
2. Otherwise, holding the sandbox's lock and its activation claim
   (:mod:`turnstile_substrate.locks`), look again, resolve the client
   (``inherit`` reads the record; a NULL record charges ``unattributed`` and
   stays NULL: C4, A4), ask the substrate for its plan, and ``Admit`` with the
   plan's kind and candidate nodes.
3. From the moment a hold exists, every exit either commits it or cancels it:
   the substrate makes the runtime exist (running the cap gate before each one
   it creates), the attribution, execution and (Direct) receipt are written in
   one transaction, fenced by the claim, and the hold is committed. Any failure
   stops what was created, cancels the hold and leaves no row (compensation),
   then answers with a clean error: retryable UNAVAILABLE when a dependency
   failed.

No database connection is held across a remote call (SPEC F7): each read or
write borrows one from the pool for its statement or transaction only.

The runtime's client label and ``activating_client_id`` are written from the
same value (``record_value`` of the charged client), so they always agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

import asyncpg
from prometheus_client import Counter, Histogram

from turnstile_clientkeys import Client, ClientForm, record_value
from turnstile_contracts import common_pb2
from turnstile_platform.authz.ownership import CallerScope
from turnstile_platform.background import run_to_end
from turnstile_platform.decision_log import DecisionLogWriter
from turnstile_platform.dependencies import (
    DEPENDENCY_ERRORS,
    DependencyOverloaded,
    DependencyUnavailable,
)
from turnstile_platform.errors import RichError, conflict, retry_later
from turnstile_platform.metric_children import Children
from turnstile_platform.shared_limits import SHARED_LIMIT, log_detail
from turnstile_substrate.admission_client import AdmissionClient, Admitted
from turnstile_substrate.db import records
from turnstile_substrate.db.claims import Claim, ClaimLostError
from turnstile_substrate.db.pool import Connection
from turnstile_substrate.db.records import SandboxRecord
from turnstile_substrate.flights import (
    Flight,
    Flights,
    FlowWaits,
    WaitKind,
    WaitRefusedError,
    flow_of,
)
from turnstile_substrate.locks import KeyedLocks, LockTimeoutError, SandboxClaims
from turnstile_substrate.runtime import CreateKind, Plan, Runtime, RuntimeSpec, Substrate
from turnstile_substrate.settings import SubstrateSettings

log = logging.getLogger(__name__)

ACTIVATIONS = Counter(
    "turnstile_substrate_activations_total",
    "Activate calls, by substrate and result (an outcome, or the error reason).",
    ["substrate", "result"],
)
ACTIVATION_SECONDS = Histogram(
    "turnstile_substrate_activation_seconds",
    "Activate latency, by substrate and result.",
    ["substrate", "result"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
#: Their children, looked up once per label values (substrates and results are few).
_activations = Children(ACTIVATIONS)
_activation_seconds = Children(ACTIVATION_SECONDS)
COMPENSATIONS = Counter(
    "turnstile_substrate_compensations_total",
    "Activations undone after Admit (runtime stopped, hold cancelled), by what failed.",
    ["stage"],
)

#: Substrates that write start/restore receipts (SPEC S7).
RECEIPT_SUBSTRATES = frozenset({"direct"})

T = TypeVar("T")


class Outcome(enum.Enum):
    """What an Activate did (``substrate.v1.Outcome``)."""

    ALREADY_RUNNING = "already_running"
    CREATED = "created"
    WARM_CLAIMED = "warm_claimed"
    RESTORED = "restored"
    RESUMED = "resumed"


OUTCOMES = {
    CreateKind.COLD: Outcome.CREATED,
    CreateKind.WARM: Outcome.WARM_CLAIMED,
    CreateKind.RESTORE: Outcome.RESTORED,
    CreateKind.RESUME: Outcome.RESUMED,
}


@dataclass(frozen=True)
class Activation:
    """The result of an Activate."""

    record: SandboxRecord | None
    #: None only for a dry run that would make one.
    runtime: Runtime | None
    outcome: Outcome
    #: The bounded key admission charged; None when nothing was charged.
    key: common_pb2.BoundedKey | None = None
    #: How long admission's fair queue made it wait (None: it did not wait).
    waited_s: float | None = None
    #: Its position among its key's waiters when it joined admission's queue (0: it did not).
    queue_position: int = 0
    #: The wait admission estimated when it joined (None: it did not, or no estimate).
    estimated_wait_s: float | None = None
    #: A dry run (SPEC Q4): ``outcome`` is what the activation would do; nothing
    #: was made, recorded, claimed or charged.
    dry_run: bool = False
    #: A dry run without a runtime: the client id it would charge (None: NULL).
    would_charge: str | None = None


@dataclass(frozen=True)
class Waiting:
    """How a call may wait on another's work on its sandbox (SPEC N2): who calls
    (its flow is that and the client it charges) and for how long at most."""

    identity: str
    limit_s: float
    #: The client the call charges, once known (an ``inherit`` is its record's).
    charged: Client | None = None

    @property
    def flow(self) -> str:
        return flow_of(self.identity, self.charged)

    def charging(self, charged: Client) -> Waiting:
        return dataclasses.replace(self, charged=charged)


@dataclass(frozen=True)
class SandboxView:
    """A sandbox as GetSandbox shows it: its record and its runtime, if it runs."""

    record: SandboxRecord | None
    runtime: Runtime | None


def activation_in_progress(sandbox_id: str, retry_after_s: float) -> RichError:
    return retry_later(
        common_pb2.ERROR_REASON_SANDBOX_PENDING,
        f"another activation of sandbox {sandbox_id!r} is still in progress; retry",
        retry_after_s,
        sandbox_id=sandbox_id,
    )


def wait_refused(error: WaitRefusedError, retry_after_s: float) -> RichError:
    """A call that may not (or no longer) wait on another's work on the sandbox
    (SPEC N2): ``ABORTED``, nothing done, retry after the hint."""
    words = {
        "flow_full": f"too many calls of this caller ({error.limit}) already wait on"
        " activations in progress here",
        "timed_out": "it did not end within this call's wait",
        "leader_gone": "the activation this call joined ended without an answer",
        "other_request": "it was asked for another client or tier",
    }
    metadata = {"sandbox_id": error.sandbox_id, "why": error.why, "wait": error.kind.value}
    if error.limit:
        metadata["limit"] = str(error.limit)
    return conflict(
        common_pb2.ERROR_REASON_SANDBOX_PENDING,
        f"another call on sandbox {error.sandbox_id!r} is in progress and this one"
        f" cannot wait for it: {words.get(error.why, error.why)}; retry",
        retry_after_s,
        **metadata,
    )


def runtime_failed(sandbox_id: str, retry_after_s: float) -> RichError:
    return retry_later(
        common_pb2.ERROR_REASON_RUNTIME_FAILED,
        f"the runtime of sandbox {sandbox_id!r} could not be started; retry",
        retry_after_s,
        sandbox_id=sandbox_id,
    )


#: Refusals admission gave (its reasons): the decision log calls them all
#: ``refused_by_admission`` and says which in words.
ADMISSION_REASONS = frozenset(
    {
        "cap_exceeded",
        "rate_limited",
        "concurrency_limited",
        "node_slots_exhausted",
        "policy_backend_unavailable",
    }
)
_WORDS = {
    Outcome.ALREADY_RUNNING: "already running: nothing created or charged",
    Outcome.CREATED: "created a new runtime",
    Outcome.WARM_CLAIMED: "claimed a warm runtime",
    Outcome.RESTORED: "restored the workspace into a new runtime",
    Outcome.RESUMED: "resumed the paused runtime",
}


def decision_words(
    result: str, activation: Activation | None, failure: RichError | None
) -> tuple[str, str]:
    """An Activate's kind and why, as the decision log holds them (SPEC Q3)."""
    if activation is not None:
        words = _WORDS[activation.outcome]
        runtime = activation.runtime
        if runtime is not None and activation.outcome is not Outcome.ALREADY_RUNNING:
            words += f" {runtime.name}" + (f" on node {runtime.node}" if runtime.node else "")
        return activation.outcome.value, words
    if result in ADMISSION_REASONS:
        if failure is not None and SHARED_LIMIT in failure.metadata:
            # Marked, so a scoped reader gets only "the cluster is contended" (SPEC N5).
            return "refused_by_admission", log_detail(failure.message)
        return "refused_by_admission", failure.message if failure else result
    if result == "runtime_failed":
        return "runtime_failed", "the runtime could not be started; the hold was cancelled"
    return result, failure.message if failure else result.replace("_", " ")


def charged_client(client: Client, record: SandboxRecord | None) -> Client:
    """Who this activation charges: ``inherit`` means the record's client (C4)."""
    if client.form is ClientForm.INHERIT:
        return Client.from_record(record.activating_client_id if record else None)
    return client


def check_owner(
    scope: CallerScope | None,
    sandbox_id: str,
    record: SandboxRecord | None,
    runtime: Runtime | None,
    *,
    recorded_only: bool,
) -> None:
    """Refuse a scoped caller a sandbox recorded to a client it may not act for (SPEC O1),
    with the authorizer's answer for one that does not exist. The owner is the record's
    client, or the running runtime's label when the record names none (or is unreadable)."""
    if scope is None:
        return
    recorded = record.activating_client_id if record is not None else None
    if recorded is None and runtime is not None:
        recorded = runtime.client_label
    if not scope.owns(sandbox_id, recorded, recorded_only=recorded_only):
        raise scope.refusal(sandbox_id)


def records_runtime(record: SandboxRecord | None, runtime: Runtime) -> bool:
    """Whether the record's active execution is this runtime."""
    return (
        record is not None
        and record.state == "running"
        and record.execution is not None
        and record.execution.runtime_name == runtime.name
    )


class Activator:
    """The Activate/Deactivate domain, independent of gRPC."""

    def __init__(
        self,
        substrate: Substrate,
        pool: asyncpg.Pool,
        admission: AdmissionClient,
        settings: SubstrateSettings,
        decisions: DecisionLogWriter | None = None,
    ) -> None:
        self.substrate = substrate
        #: Where each Activate's outcome and why go (SPEC Q3): the decision log.
        self._decisions = decisions
        self._pool = pool
        self._admission = admission
        #: Calls waiting on another's work on a sandbox, bounded per flow (SPEC N2).
        self._waits = FlowWaits(settings.activation_waiters_per_flow)
        self._locks = KeyedLocks(self._waits)
        #: The activations in progress here, which later Activates of the sandbox join.
        self._flights: Flights[Activation] = Flights()
        self._claims = SandboxClaims(
            pool,
            ttl_s=settings.activation_claim_ttl_s,
            max_s=settings.activation_claim_max_s,
            database_timeout_s=settings.database_timeout_s,
        )
        self._lock_timeout_s = settings.activation_lock_timeout_s
        self._db_timeout_s = settings.database_timeout_s
        self._retry_after_s = settings.retry_after_s
        self._receipts = substrate.name in RECEIPT_SUBSTRATES

    # -- Activate ------------------------------------------------------------

    async def activate(
        self,
        sandbox_id: str,
        client: Client,
        tier: str,
        scope: CallerScope | None = None,
        wait_s: float = 0.0,
        *,
        queue_per_client: bool = False,
        dry_run: bool = False,
        identity: str = "",
        wait_id: str = "",
        remaining_s: float | None = None,
    ) -> Activation:
        """Make the sandbox's runtime exist, charged to ``client`` (see module doc).

        A ``scope`` (a caller not allowed every client) must own the sandbox: checked
        on each record read here (the already-running path, then under the claim),
        before anything is made or admitted. ``wait_s``: how long admission may
        keep the call in its fair queue (SPEC Q1; 0: answer at once), for its
        client's own limits too with ``queue_per_client``; ``wait_id`` names the
        wait for the caller's GetQueuePosition, passed down to Admit. A dry run
        (SPEC Q4) never waits: admission decides it at once, queueing nothing.

        While another Activate of the sandbox runs here, this one joins it (SPEC N2:
        see :mod:`turnstile_substrate.flights`); a wait on another call's work lasts
        at most ``activation_lock_timeout_s`` and the call's ``remaining_s``."""
        if dry_run:
            return await self._guard(self._dry_run(sandbox_id, client, tier, scope))
        started = time.perf_counter()
        result = "error"
        activation: Activation | None = None
        failure: RichError | None = None
        try:
            activation = await self._guard(
                self._activate(
                    sandbox_id,
                    client,
                    tier,
                    scope,
                    Waiting(identity, self._wait_limit(remaining_s)),
                    wait_s,
                    queue_per_client,
                    wait_id,
                )
            )
            result = activation.outcome.value
            return activation
        except RichError as error:
            result = error.reason.lower() or error.code.name.lower()
            failure = error
            raise
        except DependencyUnavailable as error:
            # Answered UNAVAILABLE / DEPENDENCY_UNAVAILABLE by the interceptor.
            result = "dependency_unavailable"
            log.warning("dependency unavailable: %s", error.dependency, extra={"error": str(error)})
            raise
        except DependencyOverloaded as error:
            result = "replica_overloaded"
            log.warning("replica overloaded: %s", error.dependency, extra={"error": str(error)})
            raise
        finally:
            _activations(self.substrate.name, result).inc()
            _activation_seconds(self.substrate.name, result).observe(time.perf_counter() - started)
            if self._decisions is not None:
                self._log(sandbox_id, client, identity, result, activation, failure)

    def _log(
        self,
        sandbox_id: str,
        client: Client,
        identity: str,
        result: str,
        activation: Activation | None,
        failure: RichError | None,
    ) -> None:
        """The Activate's outcome and why, in the decision log (queued: off the call's path)."""
        assert self._decisions is not None
        kind, detail = decision_words(result, activation, failure)
        runtime = activation.runtime if activation is not None else None
        self._decisions.append(
            kind,
            sandbox_id=sandbox_id,
            client=client.client_id if client.client_id is not None else client.form.value,
            identity=identity,
            key=activation.key.key if activation is not None and activation.key else "",
            node=runtime.node if runtime is not None else "",
            detail=detail,
        )

    async def _activate(
        self,
        sandbox_id: str,
        client: Client,
        tier: str,
        scope: CallerScope | None,
        waiting: Waiting,
        wait_s: float = 0.0,
        queue_per_client: bool = False,
        wait_id: str = "",
    ) -> Activation:
        inherit = client.form is ClientForm.INHERIT
        flight = self._flights.get(sandbox_id)
        if flight is not None:
            return await self._join(flight, client, tier, scope, waiting)
        runtime = await self.substrate.find_running(sandbox_id)
        record: SandboxRecord | None = None
        if runtime is not None:
            try:
                record = await self._read(sandbox_id)
            except DependencyUnavailable:
                # Never refused (S5), not even by a PostgreSQL outage: the
                # runtime's own label says who it is charged to.
                log.warning("answering from the runtime: PostgreSQL unavailable")
                check_owner(scope, sandbox_id, None, runtime, recorded_only=inherit)
                return Activation(None, runtime, Outcome.ALREADY_RUNNING)
            check_owner(scope, sandbox_id, record, runtime, recorded_only=inherit)
            if records_runtime(record, runtime):
                return Activation(record, runtime, Outcome.ALREADY_RUNNING)
        else:
            # Checked before leading, so a caller that does not own the sandbox never
            # holds a flight that its owner's calls would have to join.
            record = await self._read(sandbox_id)
            check_owner(scope, sandbox_id, record, None, recorded_only=inherit)
        flight = self._flights.get(sandbox_id)  # another call may lead since the reads
        if flight is not None:
            return await self._join(flight, client, tier, scope, waiting)
        owner = record.activating_client_id if record is not None else None
        charged = charged_client(client, record)
        asked_tier = record.tier if record is not None else tier
        with self._flights.lead(
            sandbox_id, charged, asked_tier, owner, record is not None
        ) as flight:
            activation = await self._lead(
                sandbox_id,
                client,
                tier,
                scope,
                waiting.charging(charged),
                wait_s,
                queue_per_client,
                wait_id,
            )
            flight.result = activation
            return activation

    async def _join(
        self,
        flight: Flight[Activation],
        client: Client,
        tier: str,
        scope: CallerScope | None,
        waiting: Waiting,
    ) -> Activation:
        """Answer from ``flight``'s outcome: its runtime as ALREADY_RUNNING (this call
        made and charged nothing), or the refusal or failure it ended with. The
        caller's ownership is checked first, exactly as a leader's is, and again
        against the runtime and record the activation answered with. Only a call
        charging the same client for the same tier joins (an ``inherit``, such as a
        gateway's wake, joins its record's client's activation)."""
        sandbox_id = flight.sandbox_id
        inherit = client.form is ClientForm.INHERIT
        if scope is not None and not scope.owns(sandbox_id, flight.recorded, recorded_only=inherit):
            raise scope.refusal(sandbox_id)
        # What admission would decide on: the client charged (an ``inherit``: the
        # record's) and the tier (an existing sandbox's: its record's).
        charged = client if not inherit else Client.from_record(flight.recorded)
        if not flight.accepts(charged, flight.tier if flight.restoring else tier):
            raise WaitRefusedError(sandbox_id, WaitKind.JOIN, "other_request")
        with self._waits.wait(waiting.charging(charged).flow, sandbox_id, WaitKind.JOIN):
            try:
                led = await flight.answer(waiting.limit_s)
            except RichError as error:
                raise dataclasses.replace(error) from None  # one error object per call
        check_owner(scope, sandbox_id, led.record, led.runtime, recorded_only=inherit)
        return Activation(led.record, led.runtime, Outcome.ALREADY_RUNNING)

    async def _lead(
        self,
        sandbox_id: str,
        client: Client,
        tier: str,
        scope: CallerScope | None,
        waiting: Waiting,
        wait_s: float,
        queue_per_client: bool,
        wait_id: str,
    ) -> Activation:
        """The activation itself, under the sandbox's lock and claim."""
        inherit = client.form is ClientForm.INHERIT
        async with self._locked(sandbox_id, waiting) as claim:
            record, generation = await self._db(lambda conn: _read_for_activation(conn, sandbox_id))
            runtime = await self.substrate.find_running(sandbox_id)
            check_owner(scope, sandbox_id, record, runtime, recorded_only=inherit)
            if runtime is not None:
                if not records_runtime(record, runtime):
                    # Its activation died between creating and recording it.
                    found = runtime
                    record = await self._db(
                        lambda conn: records.adopt_runtime(
                            conn, found, substrate=self.substrate.name, claim=claim
                        )
                    )
                return Activation(record, runtime, Outcome.ALREADY_RUNNING)
            return await self._create(
                claim,
                sandbox_id,
                client,
                tier,
                record,
                generation,
                wait_s,
                queue_per_client,
                wait_id,
            )

    async def _dry_run(
        self, sandbox_id: str, client: Client, tier: str, scope: CallerScope | None
    ) -> Activation:
        """What an Activate would do, changing nothing (SPEC Q4): the record and the
        runtime are read (no claim, no lock: nothing is written), ownership checked
        as a real Activate checks it, and admission asked for a dry run, whose
        refusal is raised as a real one is. No metric of activations moves."""
        inherit = client.form is ClientForm.INHERIT
        runtime = await self.substrate.find_running(sandbox_id)
        record, generation = await self._db(lambda conn: _read_for_activation(conn, sandbox_id))
        check_owner(scope, sandbox_id, record, runtime, recorded_only=inherit)
        if runtime is not None:
            return Activation(record, runtime, Outcome.ALREADY_RUNNING, dry_run=True)
        charged = charged_client(client, record)
        spec = RuntimeSpec(
            sandbox_id=sandbox_id,
            tier=record.tier if record is not None else tier,
            client_label=record_value(charged),
            restore=record is not None,
            generation=generation,
        )
        plan = self.substrate.plan(spec)
        admitted = await self._admission.admit(
            sandbox_id, charged, plan.kind, spec.tier, plan.candidate_nodes, dry_run=True
        )
        return Activation(
            record,
            None,
            OUTCOMES[plan.kind],
            admitted.key,
            dry_run=True,
            would_charge=record_value(charged),
        )

    async def _create(
        self,
        claim: Claim,
        sandbox_id: str,
        client: Client,
        tier: str,
        record: SandboxRecord | None,
        generation: int,
        wait_s: float = 0.0,
        queue_per_client: bool = False,
        wait_id: str = "",
    ) -> Activation:
        charged = charged_client(client, record)
        spec = RuntimeSpec(
            sandbox_id=sandbox_id,
            tier=record.tier if record is not None else tier,
            client_label=record_value(charged),
            restore=record is not None,
            generation=generation,
        )
        plan = self.substrate.plan(spec)
        admitted = await self._admission.admit(
            sandbox_id,
            charged,
            plan.kind,
            spec.tier,
            plan.candidate_nodes,
            wait_s,
            queue_per_client=queue_per_client,
            wait_id=wait_id,
        )
        runtime: Runtime | None = None
        stage = "runtime"
        try:
            runtime = await self._ensure_runtime(spec, plan, admitted, charged)
            stage = "record"
            made = runtime
            recorded = await self._db(
                lambda conn: records.record_activation(
                    conn,
                    made,
                    substrate=self.substrate.name,
                    charged_key=admitted.key.key,
                    receipt=records.receipt_kind(made.kind) if self._receipts else None,
                    claim=claim,
                )
            )
        except ClaimLostError as error:
            # Another owner took the sandbox over after this claim lapsed: the runtime
            # (the same deterministic one) is its to record or remove now; only this
            # attempt's hold is undone.
            COMPENSATIONS.labels("claim_lost").inc()
            await run_to_end(self._compensate(sandbox_id, admitted, stop_runtime=False))
            raise activation_in_progress(sandbox_id, self._retry_after_s) from error
        except BaseException as error:
            # The runtime must go if it may exist: it was made, or its making
            # was interrupted. A RichError from the substrate (the cap gate), or a
            # failing dependency (a credential not recorded), means nothing was made.
            stop = runtime is not None or not isinstance(error, (RichError, *DEPENDENCY_ERRORS))
            COMPENSATIONS.labels(stage).inc()
            await run_to_end(self._compensate(sandbox_id, admitted, stop_runtime=stop))
            raise
        await run_to_end(
            self._admission.commit(admitted.hold_id, creation_prepaid=runtime.creation_paid)
        )
        return Activation(
            recorded,
            runtime,
            OUTCOMES[runtime.kind],
            admitted.key,
            admitted.waited_s,
            queue_position=admitted.queue_position,
            estimated_wait_s=admitted.estimated_wait_s,
        )

    async def _ensure_runtime(
        self, spec: RuntimeSpec, plan: Plan, admitted: Admitted, charged: Client
    ) -> Runtime:
        gate = self._admission.cap_gate(admitted, charged)
        try:
            return await self.substrate.ensure_runtime(spec, plan, gate)
        except (RichError, *DEPENDENCY_ERRORS, asyncio.CancelledError):
            raise  # answered as they are (a failing dependency by the interceptor)
        except Exception as error:
            log.exception("runtime creation failed", extra={"sandbox_id": spec.sandbox_id})
            raise runtime_failed(spec.sandbox_id, self._retry_after_s) from error

    async def _compensate(self, sandbox_id: str, admitted: Admitted, *, stop_runtime: bool) -> None:
        """Undo an admitted activation: stop what was made, then cancel the hold
        (in that order, so the cap never sees room while the runtime still runs)."""
        if stop_runtime:
            try:
                await self.substrate.stop_runtime(sandbox_id)
            except Exception:
                log.exception(
                    "compensation could not stop the runtime", extra={"sandbox_id": sandbox_id}
                )
        await self._admission.cancel(admitted.hold_id)

    # -- Deactivate ----------------------------------------------------------

    async def deactivate(
        self,
        sandbox_id: str,
        scope: CallerScope | None = None,
        *,
        identity: str = "",
        remaining_s: float | None = None,
    ) -> bool:
        """Stop the runtime, end its execution, free its admission slot. Idempotent.

        The admission release runs under the sandbox lock, so it cannot free the
        slot of an activation of the same sandbox that starts right after. A
        ``scope`` must own the sandbox, checked under that lock. Waiting for the lock
        counts against the caller's flow (SPEC N2), as an Activate's does.
        """
        waiting = Waiting(identity, self._wait_limit(remaining_s))

        async def run() -> bool:
            async with self._locked(sandbox_id, waiting) as claim:
                if scope is not None:
                    record = await self._read(sandbox_id)
                    check_owner(scope, sandbox_id, record, None, recorded_only=True)
                stopped = await self.substrate.stop_runtime(sandbox_id)
                await self._db(
                    lambda conn: records.end_execution(
                        conn, sandbox_id, reason="deactivated", claim=claim
                    )
                )
                await self._admission.release_sandbox(sandbox_id)
                return stopped

        return await self._guard(run())

    # -- reads ---------------------------------------------------------------

    async def get(self, sandbox_id: str, scope: CallerScope | None = None) -> SandboxView:
        """The sandbox's record and, if it runs, its runtime (a ``scope`` must own it)."""

        async def run() -> SandboxView:
            record = await self._read(sandbox_id)
            runtime = await self.substrate.find_running(sandbox_id)
            check_owner(scope, sandbox_id, record, runtime, recorded_only=True)
            return SandboxView(record, runtime)

        return await self._guard(run())

    async def list(
        self, *, limit: int, after: tuple[datetime, str] | None, client_id: str | None
    ) -> list[SandboxRecord]:
        return await self._guard(
            self._db(
                lambda conn: records.list_sandboxes(
                    conn, limit=limit, after=after, client_id=client_id
                )
            )
        )

    # -- plumbing ------------------------------------------------------------

    async def _read(self, sandbox_id: str) -> SandboxRecord | None:
        return await self._db(lambda conn: records.fetch_sandbox(conn, sandbox_id))

    async def _db(self, statements: Callable[[Connection], Awaitable[T]]) -> T:
        """Run ``statements`` on a connection borrowed for them alone (never across a
        remote call: SPEC F7)."""
        async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
            return await statements(conn)

    def _wait_limit(self, remaining_s: float | None) -> float:
        """How long a call may wait on another's work: ``activation_lock_timeout_s``,
        or less if its deadline is nearer."""
        if remaining_s is None:
            return self._lock_timeout_s
        return max(0.0, min(self._lock_timeout_s, remaining_s))

    @asynccontextmanager
    async def _locked(self, sandbox_id: str, waiting: Waiting) -> AsyncIterator[Claim]:
        """The sandbox's in-process lock (a wait for it counted against the caller's
        flow), then its activation claim, both within ``waiting.limit_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + waiting.limit_s
        async with self._locks.hold(sandbox_id, waiting.limit_s, waiting.flow):
            remaining = max(0.0, deadline - loop.time())
            async with self._claims.hold(sandbox_id, remaining) as claim:
                yield claim

    async def _guard(self, work: Awaitable[T]) -> T:
        """Map lock timeouts and lost claims to retryable errors (a failing PostgreSQL
        is the platform interceptor's to answer)."""
        try:
            return await work
        except RichError:
            raise
        except WaitRefusedError as error:
            raise wait_refused(error, self._retry_after_s) from None
        except LockTimeoutError as error:
            raise activation_in_progress(str(error), self._retry_after_s) from error
        except ClaimLostError as error:
            # This claim lapsed and another owner took the sandbox over: its write stands.
            raise activation_in_progress(error.claim.sandbox_id, self._retry_after_s) from error


async def _read_for_activation(
    conn: Connection, sandbox_id: str
) -> tuple[SandboxRecord | None, int]:
    """The sandbox's record and the number of its next activation (the generation the
    Kubernetes substrate names the pod by), read under the claim."""
    record = await records.fetch_sandbox(conn, sandbox_id)
    return record, await records.activation_generation(conn, sandbox_id)
