"""Leader election over a ``coordination.k8s.io/v1`` ``Lease``, with fencing (SPEC F1).

Work that must happen once per cluster (the warm-pool refill and trim, the sweeps, publishing
live counts) registers on the process's :class:`Leadership` with :meth:`~Leadership.add_work`;
it runs only while this replica leads and is cancelled when it stops leading.

Why not ``kubernetes_asyncio.leaderelection``: it runs one term and returns, puts no bound on a
renew call (a hung API server keeps a deposed leader "leading" past its deadline), has no epoch,
never releases the lease and refuses periods under a second. This module keeps its algorithm
(client-go's) and adds what fencing needs: expiry by observation on the candidate's own clock,
optimistic writes, work stopped before the renew deadline passes, an epoch
(:attr:`LeaderTerm.epoch`) and release on shutdown; docs/architecture.md ("Leader election")
explains each.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge

from turnstile_platform.background import BackgroundTasks

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

log = logging.getLogger(__name__)

IS_LEADER = Gauge(
    "turnstile_leader_is_leader",
    "1 while this process holds the lease (leads), 0 otherwise.",
    ["lease"],
)
TRANSITIONS = Counter(
    "turnstile_leader_transitions_total",
    "Times this process started or stopped leading, by event (acquired, lost, released).",
    ["lease", "event"],
)
WORK_RESTARTS = Counter(
    "turnstile_leader_work_restarts_total",
    "Leader-only work that returned or raised while still leading and was restarted.",
    ["work"],
)

#: First and longest wait before restarting leader work that returned or raised.
_WORK_BACKOFF_S = 0.5
_WORK_BACKOFF_MAX_S = 30.0


@dataclass(frozen=True)
class LeaderTerm:
    """One term of leadership, handed to every piece of leader-only work."""

    identity: str
    """This replica's holder identity."""
    epoch: int
    """Fencing number: strictly greater each time leadership changes hands."""


LeaderWork = Callable[[LeaderTerm], Awaitable[None]]


class Leadership(Protocol):
    """What a service needs from its leader: register work, run, ask."""

    def add_work(self, name: str, work: LeaderWork) -> None: ...

    async def run(self) -> None: ...

    @property
    def is_leader(self) -> bool: ...


def default_identity() -> str:
    """``<hostname>_<random>``: the pod name in a cluster, unique per process anyway (two
    processes on one host, or a restarted container, must not share an identity)."""
    host = os.environ.get("POD_NAME") or socket.gethostname() or "turnstile"
    return f"{host}_{uuid.uuid4().hex[:8]}"


class _WorkSet:
    """The registered work and, while leading, one supervising task per piece."""

    def __init__(self) -> None:
        self._work: dict[str, LeaderWork] = {}
        # Only while this replica leads: started with each term, closed when it ends.
        self._running = BackgroundTasks("leader work")
        self._term: LeaderTerm | None = None

    def add(self, name: str, work: LeaderWork) -> None:
        if name in self._work:
            raise ValueError(f"leader work {name!r} is already registered")
        self._work[name] = work
        if self._term is not None:
            self._start(name, work, self._term)

    def start(self, term: LeaderTerm) -> None:
        self._term = term
        for name, work in self._work.items():
            self._start(name, work, term)

    def _start(self, name: str, work: LeaderWork, term: LeaderTerm) -> None:
        # Leader work runs while leading: one that returns or raises is restarted.
        self._running.supervise(
            functools.partial(work, term),
            name=f"leader-{name}",
            backoff_s=_WORK_BACKOFF_S,
            max_backoff_s=_WORK_BACKOFF_MAX_S,
            forever=True,
            on_restart=WORK_RESTARTS.labels(work=name).inc,
        )

    async def stop(self) -> None:
        """Cancel every running piece and wait until each has finished."""
        self._term = None
        await self._running.close()


class LocalLeadership:
    """Always the leader (epoch 1): one process is the whole deployment, nothing to elect.

    The Direct substrate runs its runtimes on one host, so it uses this; a service that may run
    as several replicas uses :class:`LeaderElector` instead.
    """

    def __init__(self, identity: str = "local") -> None:
        self._identity = identity
        self._works = _WorkSet()
        self._running = False

    def add_work(self, name: str, work: LeaderWork) -> None:
        self._works.add(name, work)

    async def run(self) -> None:
        """Run the work until cancelled."""
        self._running = True
        self._works.start(LeaderTerm(self._identity, 1))
        try:
            await asyncio.Event().wait()
        finally:
            self._running = False
            await self._works.stop()

    @property
    def is_leader(self) -> bool:
        return self._running


class LeaseApiError(Exception):
    """The API server answered a Lease call with an error status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"{status}: {body[:200].decode(errors='replace')}")
        self.status = status


@dataclass(frozen=True)
class _Record:
    holder: str
    duration_s: float
    transitions: int
    resource_version: str
    acquire_time: str | None
    renew_time: str | None

    @classmethod
    def parse(cls, obj: dict[str, Any], default_duration_s: float) -> _Record:
        spec = obj.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_s=float(spec.get("leaseDurationSeconds") or default_duration_s),
            transitions=int(spec.get("leaseTransitions") or 0),
            resource_version=str((obj.get("metadata") or {}).get("resourceVersion", "")),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
        )

    def same_term(self, other: _Record | None) -> bool:
        """Whether ``other`` shows the same holder with no renewal since (the expiry clock)."""
        return other is not None and (self.holder, self.renew_time, self.transitions) == (
            other.holder,
            other.renew_time,
            other.transitions,
        )


def _micro_time() -> str:
    """``metav1.MicroTime`` as the API server writes it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Elects one leader among the processes sharing ``namespace/lease_name``.

    ``identity`` must be unique per process (:func:`default_identity`). Work added with
    :meth:`add_work` starts when this process becomes leader and is cancelled and awaited when it
    loses the lease or cannot renew within ``renew_deadline_s``; leader work must therefore
    react to cancellation promptly (no long shielded sections).
    """

    def __init__(
        self,
        api_client: ApiClient,
        *,
        namespace: str,
        lease_name: str,
        identity: str,
        lease_duration_s: float = 15,
        renew_deadline_s: float = 10,
        retry_period_s: float = 2,
    ) -> None:
        if not 0 < retry_period_s < renew_deadline_s < lease_duration_s:
            raise ValueError(
                "leader election needs 0 < retry_period_s < renew_deadline_s < lease_duration_s"
            )
        if not identity:
            raise ValueError("leader election needs a non-empty identity")
        from kubernetes_asyncio.client import CoordinationV1Api

        self._api = CoordinationV1Api(api_client)
        self.namespace = namespace
        self.lease_name = lease_name
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.retry_period_s = retry_period_s
        self._works = _WorkSet()
        self._term: LeaderTerm | None = None
        self._observed: _Record | None = None
        self._observed_at = 0.0
        self._changed = asyncio.Condition()
        self._renewed_at = 0.0

    # ------------------------------------------------------------------ public

    def add_work(self, name: str, work: LeaderWork) -> None:
        """Register leader-only work (started at once if this process already leads)."""
        self._works.add(name, work)

    @property
    def is_leader(self) -> bool:
        return self._term is not None

    @property
    def term(self) -> LeaderTerm | None:
        """The current term while leading, else None."""
        return self._term

    async def wait_leading(self, leading: bool = True) -> None:
        """Wait until this process leads (or, with ``leading=False``, does not)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.is_leader == leading)

    async def run(self) -> None:
        """Campaign, lead, and campaign again after losing, until cancelled; a lease held at
        cancellation is released."""
        try:
            while True:
                await self._acquire()
                await self._lead()
        finally:
            if self._term is not None:
                await self._stop_leading("released")
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(self.retry_period_s):
                        await self._release()

    # ------------------------------------------------------------------ the loop

    async def _acquire(self) -> None:
        while True:
            started = time.monotonic()
            epoch = await self._attempt(timeout=self.retry_period_s)
            if epoch is not None:
                await self._start_leading(LeaderTerm(self.identity, epoch), started)
                return
            await asyncio.sleep(self.retry_period_s)

    async def _lead(self) -> None:
        """Renew every retry period; stop leading when the renew deadline passes."""
        assert self._term is not None
        while True:
            await asyncio.sleep(self.retry_period_s)
            while True:
                left = self._renewed_at + self.renew_deadline_s - time.monotonic()
                if left <= 0:
                    log.warning(
                        "lease %s not renewed within %.1fs; stepping down",
                        self.lease_name,
                        self.renew_deadline_s,
                    )
                    await self._stop_leading("lost")
                    return
                started = time.monotonic()
                epoch = await self._attempt(timeout=left)
                if epoch == self._term.epoch:
                    self._renewed_at = started
                    break
                if epoch is not None or self._held_by_other():
                    log.warning("lease %s was taken over; stepping down", self.lease_name)
                    await self._stop_leading("lost")
                    return
                await asyncio.sleep(min(self.retry_period_s, max(0.0, left)))

    def _held_by_other(self) -> bool:
        observed = self._observed
        return observed is not None and observed.holder not in ("", self.identity)

    async def _attempt(self, timeout: float) -> int | None:
        """One try to acquire or renew; the epoch held on success, None otherwise."""
        try:
            async with asyncio.timeout(timeout):
                return await self._try_acquire_or_renew()
        except TimeoutError:
            log.info("lease %s: call timed out", self.lease_name)
        except LeaseApiError as error:
            if error.status != 409:
                log.info("lease %s: %s", self.lease_name, error)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            log.info("lease %s: %s: %s", self.lease_name, type(error).__name__, error)
        return None

    async def _try_acquire_or_renew(self) -> int | None:
        current = await self._get()
        now = time.monotonic()
        if current is None:
            await self._create()
            self._observe(None, now)
            return 0
        record = _Record.parse(current, self.lease_duration_s)
        if not record.same_term(self._observed):
            self._observe(record, now)
        mine = record.holder == self.identity
        if (
            record.holder
            and not mine
            and self._observed_at + record.duration_s > now  # not expired yet
        ):
            return None
        transitions = record.transitions if mine else record.transitions + 1
        spec = dict(current.get("spec") or {})
        stamp = _micro_time()
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=math.ceil(self.lease_duration_s),
            renewTime=stamp,
            leaseTransitions=transitions,
        )
        if not mine:
            spec["acquireTime"] = stamp
        current["spec"] = spec
        updated = await self._replace(current)
        self._observe(_Record.parse(updated, self.lease_duration_s), time.monotonic())
        return transitions

    def _observe(self, record: _Record | None, now: float) -> None:
        self._observed = record
        self._observed_at = now

    async def _start_leading(self, term: LeaderTerm, renewed_at: float) -> None:
        self._term = term
        self._renewed_at = renewed_at
        IS_LEADER.labels(lease=self.lease_name).set(1)
        TRANSITIONS.labels(lease=self.lease_name, event="acquired").inc()
        log.info("leading %s as %s (epoch %d)", self.lease_name, term.identity, term.epoch)
        self._works.start(term)
        async with self._changed:
            self._changed.notify_all()

    async def _stop_leading(self, event: str) -> None:
        # Fencing: the work is stopped before anything else happens.
        await self._works.stop()
        self._term = None
        IS_LEADER.labels(lease=self.lease_name).set(0)
        TRANSITIONS.labels(lease=self.lease_name, event=event).inc()
        log.info("stopped leading %s (%s)", self.lease_name, event)
        async with self._changed:
            self._changed.notify_all()

    async def _release(self) -> None:
        current = await self._get()
        if current is None:
            return
        spec = dict(current.get("spec") or {})
        if spec.get("holderIdentity") != self.identity:
            return
        spec.update(holderIdentity=None, leaseDurationSeconds=1, renewTime=_micro_time())
        current["spec"] = spec
        await self._replace(current)

    # ------------------------------------------------------------------ API calls

    async def _get(self) -> dict[str, Any] | None:
        try:
            return await self._call(
                self._api.read_namespaced_lease, self.lease_name, self.namespace
            )
        except LeaseApiError as error:
            if error.status == 404:
                return None
            raise

    async def _create(self) -> dict[str, Any]:
        stamp = _micro_time()
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.lease_name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": math.ceil(self.lease_duration_s),
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            },
        }
        return await self._call(self._api.create_namespaced_lease, self.namespace, body)

    async def _replace(self, obj: dict[str, Any]) -> dict[str, Any]:
        """PUT with the resourceVersion read: a 409 if anyone wrote in between."""
        return await self._call(
            self._api.replace_namespaced_lease, self.lease_name, self.namespace, obj
        )

    @staticmethod
    async def _call(method: Any, *args: Any) -> dict[str, Any]:
        response = await method(*args, _preload_content=False)
        try:
            body: bytes = await response.read()
            if not 200 <= response.status <= 299:
                raise LeaseApiError(response.status, body)
        finally:
            response.release()
        doc: dict[str, Any] = json.loads(body)
        return doc
