"""The sweeps (SPEC F4): nothing Turnstile made is left behind, and no record outlives its pod.

Leader-only work: every ``sweep_interval_s`` one replica compares the reflector's
pods with the PostgreSQL records, in four sweeps: **gone runtimes** (an active
execution whose pod is gone is ended and its slot released, or follows another
live pod of its sandbox; a cache miss is confirmed with a GET), **finished pods**,
**expired warm pods** and **orphan pods** (older than the grace, re-read before
the delete, which carries the pod's uid). Gone pods are mostly caught at once by
:mod:`.gone_watch`; the pass catches what it missed. A pod whose sandbox holds a
live activation claim is left for a later pass. Sandbox pods have no
``ownerReferences`` or deadline: records in PostgreSQL own them, and the sweeps do
both jobs against the records. The table of sweeps is in
docs/substrate-kubernetes.md ("Sweeps").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.db import claims, records
from turnstile_substrate.db.claims import Claim
from turnstile_substrate.db.pool import Connection
from turnstile_substrate.kubernetes import metrics
from turnstile_substrate.kubernetes.api import KubeApiError, PodsApi
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.podinfo import PodInfo
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.locks import SandboxClaims
from turnstile_substrate.passes import log_failed_pass
from turnstile_substrate.runtime import CreateKind, Runtime

log = logging.getLogger(__name__)

SUBSTRATE = "kubernetes"

GONE = "gone_runtimes"
#: The same work, for one pod the moment the reflector sees it go (:mod:`.gone_watch`).
GONE_WATCH = "gone_runtimes_watch"
FINISHED = "finished_pods"
EXPIRED_WARM = "expired_warm_pods"
ORPHANS = "orphan_pods"

Release = Callable[[str], Awaitable[None]]


@dataclass
class SweepReport:
    """What one pass found and did, per sweep and action (found, removed, adopted, error)."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)

    def add(self, sweep: str, action: str) -> None:
        self.counts[(sweep, action)] = self.counts.get((sweep, action), 0) + 1
        metrics.SWEEPS.labels(sweep=sweep, action=action).inc()

    def get(self, sweep: str, action: str) -> int:
        return self.counts.get((sweep, action), 0)


#: The activation claim's TTL while the prompt path ends one row (it is released at once).
_CLAIM_TTL_S = 10.0


class Sweeper:
    """Runs the sweeps on the leader; :meth:`sweep_once` is one pass (tests call it)."""

    def __init__(
        self,
        api: PodsApi,
        index: PodIndex,
        settings: KubernetesSettings,
        synced: asyncio.Event,
        pool: asyncpg.Pool,
        release: Release,
        *,
        database_timeout_s: float = 5.0,
    ) -> None:
        self._api = api
        self._index = index
        self._settings = settings
        self._synced = synced
        self._pool = pool
        self._release = release
        self._db_timeout_s = database_timeout_s
        # The prompt path ends a row under the sandbox's activation claim, like an
        # activation or a Deactivate; its work is one pod read and one write.
        self._claims = SandboxClaims(
            pool, ttl_s=_CLAIM_TTL_S, max_s=_CLAIM_TTL_S, database_timeout_s=database_timeout_s
        )
        self.dry_run = settings.sweep_dry_run

    async def run(self, term: LeaderTerm) -> None:
        """Sweep every ``sweep_interval_s`` while leading."""
        await self._synced.wait()
        log.info("sweeps start (leader epoch %d, dry run: %s)", term.epoch, self.dry_run)
        while True:
            try:
                await self.sweep_once()
                metrics.SWEEP_RUNS.labels(result="ok").inc()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                metrics.SWEEP_RUNS.labels(result="error").inc()
                log_failed_pass(log, "sweep pass", error)
            await asyncio.sleep(self._settings.sweep_interval_s)

    async def sweep_once(self) -> SweepReport:
        """One pass of the four sweeps (see the module doc)."""
        report = SweepReport()
        adopted = await self._gone_runtimes(report)
        pods = list(self._index.pods.values())
        await self._finished(pods, report)
        await self._expired_warm(pods, report)
        await self._orphans(pods, adopted, report)
        if report.counts:
            log.info(
                "sweep pass%s: %s",
                " (dry run)" if self.dry_run else "",
                {f"{s}.{a}": n for (s, a), n in sorted(report.counts.items())},
            )
        return report

    # ------------------------------------------------------------------ the sweeps

    async def _gone_runtimes(self, report: SweepReport) -> set[str]:
        """End the executions whose pod is gone; returns the pods adopted instead."""
        adopted: set[str] = set()
        async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
            active = await records.active_runtimes(conn, SUBSTRATE)
        for name, execution in active.items():
            cached = self._index.pods.get(name)
            if cached is not None and cached.live:
                continue
            replacement = await self._end_gone(GONE, execution.sandbox_id, name, report)
            if replacement is not None:
                adopted.add(replacement)
        return adopted

    async def end_if_recorded(self, sandbox_id: str, name: str) -> SweepReport:
        """The prompt path of the gone-runtimes sweep, for one pod the reflector saw go
        (:mod:`.gone_watch`): if it is still the sandbox's active execution, end it (or move
        the record to the sandbox's other live pod) now rather than at the next pass.

        It holds the sandbox's activation claim meanwhile, as a Deactivate or an activation
        does: a Deactivate deletes the pod (which is how the watch hears of it) and then ends
        the row itself, with its own reason, and an activation of the sandbox must not have its
        admission slot released under it. Whatever they did, the row is read again under the
        claim, and the write is fenced by it. Idempotent: a record already ended, or naming
        another pod, is left alone; a claim not had within the database budget leaves the row
        to the next pass."""
        report = SweepReport()
        try:
            async with self._claims.hold(sandbox_id, self._db_timeout_s) as claim:
                async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
                    recorded = await records.runtime_is_recorded(conn, sandbox_id, name)
                if recorded:
                    await self._end_gone(GONE_WATCH, sandbox_id, name, report, claim)
        except Exception as error:
            report.add(GONE_WATCH, "error")
            log.warning(
                "ending the execution of pod %s failed (%s); the next pass will", name, error
            )
        return report

    async def _end_gone(
        self,
        sweep: str,
        sandbox_id: str,
        name: str,
        report: SweepReport,
        claim: Claim | None = None,
    ) -> str | None:
        """End the execution of pod ``name`` if the API server confirms it is gone, or adopt
        the sandbox's other live pod instead; returns the adopted pod's name. ``claim``: the
        sandbox's activation claim, when held; the write is then fenced by it. No database
        connection is held across the API read or the admission release (SPEC F7)."""
        try:
            pod = await self._api.get(name)  # the cache may not have seen a fresh create
        except Exception as error:
            report.add(sweep, "error")
            log.warning("sweep: reading pod %s failed: %s", name, error)
            return None
        if pod is not None and pod.live:
            return None
        report.add(sweep, "found")
        if self.dry_run:
            return None
        replacement = next((p for p in self._index.live_pods(sandbox_id) if p.name != name), None)
        try:
            async with self._fenced(claim) as db:
                if replacement is not None:
                    await records.adopt_runtime(db, _runtime(replacement), substrate=SUBSTRATE)
                    report.add(sweep, "adopted")
                    return replacement.name
                ended = await records.end_runtime(db, sandbox_id, name, reason="runtime_gone")
            if ended:
                await self._release(sandbox_id)
                report.add(sweep, "removed")
                log.info("%s: ended sandbox %s's execution (pod %s gone)", sweep, sandbox_id, name)
        except Exception as error:
            report.add(sweep, "error")
            log.warning("sweep: ending the execution of pod %s failed: %s", name, error)
        return None

    @contextlib.asynccontextmanager
    async def _fenced(self, claim: Claim | None) -> AsyncIterator[Connection]:
        """A pool connection for the block; with ``claim``, inside a transaction that first
        checks the claim is still this sweeper's (:func:`claims.fence`)."""
        async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
            if claim is None:
                yield conn
                return
            async with conn.transaction():
                await claims.fence(conn, claim)
                yield conn

    async def _finished(self, pods: list[PodInfo], report: SweepReport) -> None:
        for pod in pods:
            if pod.deleting or pod.live:
                continue
            report.add(FINISHED, "found")
            await self._delete(FINISHED, pod, report, resource_version=False)

    async def _expired_warm(self, pods: list[PodInfo], report: SweepReport) -> None:
        max_age = self._settings.sweep_warm_max_age_s
        if not max_age:
            return
        for pod in pods:
            if not pod.is_warm:
                continue
            age = pod.age_s()
            if age is None or age < max_age:
                continue
            report.add(EXPIRED_WARM, "found")
            await self._delete(EXPIRED_WARM, pod, report, resource_version=True)

    async def _orphans(self, pods: list[PodInfo], adopted: set[str], report: SweepReport) -> None:
        grace = self._settings.sweep_orphan_grace_s
        candidates = [
            pod
            for pod in pods
            if pod.live
            and not pod.is_warm
            and pod.name not in adopted
            and (age := pod.age_s()) is not None
            and age >= grace
        ]
        if not candidates:
            return
        async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
            active = await records.active_runtimes(conn, SUBSTRATE)
        for pod in candidates:
            if pod.name in active:
                continue
            if pod.sandbox_id is not None:
                try:
                    # Read again right before deleting: recorded meanwhile, or its sandbox's
                    # activation still under way (a live claim), means not an orphan.
                    async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
                        if await records.runtime_is_recorded(
                            conn, pod.sandbox_id, pod.name
                        ) or await claims.in_progress(conn, pod.sandbox_id):
                            continue
                except Exception as error:
                    report.add(ORPHANS, "error")
                    log.warning("sweep: checking pod %s failed: %s", pod.name, error)
                    continue
            report.add(ORPHANS, "found")
            await self._delete(ORPHANS, pod, report, resource_version=False)

    async def _delete(
        self, sweep: str, pod: PodInfo, report: SweepReport, *, resource_version: bool
    ) -> None:
        if self.dry_run:
            return
        try:
            deleted = await self._api.delete(
                pod.name,
                uid=pod.uid,
                resource_version=pod.resource_version if resource_version else None,
            )
        except KubeApiError as error:
            if error.conflict:
                return  # replaced or changed since the cache saw it: look again next pass
            report.add(sweep, "error")
            log.warning("sweep: deleting pod %s failed: %s", pod.name, error)
            return
        except Exception as error:
            report.add(sweep, "error")
            log.warning("sweep: deleting pod %s failed: %s", pod.name, error)
            return
        if deleted:
            report.add(sweep, "removed")
            log.info("sweep %s removed pod %s", sweep, pod.name)


def _runtime(pod: PodInfo) -> Runtime:
    """The runtime a record adopting ``pod`` names."""
    return Runtime(
        sandbox_id=pod.sandbox_id or "",
        name=pod.name,
        kind=CreateKind.COLD,
        client_label=pod.client_label,
        tier=pod.tier,
        node=pod.node,
    )
