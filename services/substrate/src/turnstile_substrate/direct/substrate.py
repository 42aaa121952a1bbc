"""The Direct substrate: each sandbox's runtime is a process on this host.

The runtime is the worker agent (``turnstile-worker``, configurable), started
in the sandbox's workspace directory with the worker's settings in its
environment. A cold start gets a fresh workspace; a restore keeps the one the
sandbox's previous runtime left (that is what is restored).
With ``direct_runtime_preload`` set, runtimes are forked from a launcher that
imported the runtime once (:mod:`.launcher`), set up the same way: a woken
session does not wait for an interpreter's start and imports.

Where the truth lives: a runtime record per sandbox in the state directory
(``<state_dir>/<sandbox_id>/runtime.json``: pid, start time, label, tier). The
processes are this host's, so this host's files, not the database, say which
exist. A runtime *runs* only while its pid still names the process that
started at the recorded time, and that process has not exited: a dead or
reused pid is not running, and its stale record is dropped.

After the substrate restarts, :meth:`DirectSubstrate.find_running` finds the
runtimes that outlived it through those records, and :meth:`stop_runtime`
stops them like its own. Runtimes are not stopped when the substrate stops
(pods do not vanish when a Kubernetes substrate restarts either).

Live counts (SPEC S4): with ``TURNSTILE_DIRECT_LIVE_COUNTS=count`` (the local
stack's) the substrate publishes its live runtimes by bounded key, as the
Kubernetes leader publishes its reflector's, so the cap applies; by default it
declares it cannot count, and the cap answers unknown (unsupported) and admits
(:mod:`turnstile_substrate.direct.live_counts`).

Sandbox credentials (SPEC Z3), when a signing key is configured: each runtime
start (cold or restore) mints a credential of a new generation, written to
``<state_dir>/<sandbox_id>/credential`` (mode 0600, replaced atomically) before
the process starts, and named in ``TURNSTILE_WORKER_CREDENTIAL_FILE``; the
generation is kept in the runtime record. A renewal pass re-mints the
credentials past half their ttl (the file's age says when it was written), for
every runtime of this host, including those adopted after a restart. It is
leader work, registered on the process's leadership (Direct: always the leader,
one host, one process), and idempotent, so it would be safe on every replica too.
Stopping a runtime revokes its credential first. Each credential attests the
runtime's presence (SPEC O3): its owner (the record's client label), tier,
capacity (``TURNSTILE_DIRECT_WORKER_CAPACITY``, else the worker's default 1) and
endpoint — empty, as Direct assigns its runtimes no address.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from turnstile_clientkeys import Resolver
from turnstile_clientkeys.live_store import LiveStore
from turnstile_platform.leader import Leadership, LeaderTerm
from turnstile_platform.redis_client import UNREACHABLE
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    Issued,
    PresenceClaims,
    write_private_file,
)
from turnstile_substrate.admission import dependency_unavailable
from turnstile_substrate.direct import processes
from turnstile_substrate.direct.launcher import Launcher
from turnstile_substrate.direct.live_counts import DirectLiveCounts, declare_unsupported
from turnstile_substrate.runtime import (
    CapGate,
    CountUnknown,
    CreateKind,
    LiveCount,
    Plan,
    Runtime,
    RuntimeSpec,
)
from turnstile_substrate.settings import SubstrateSettings

log = logging.getLogger(__name__)

#: Environment variables the worker agent reads.
ENV_SANDBOX_ID = "TURNSTILE_WORKER_SANDBOX_ID"
ENV_TIER = "TURNSTILE_WORKER_TIER"
ENV_CAPACITY = "TURNSTILE_WORKER_CAPACITY"
ENV_AFFINITY_ADDR = "TURNSTILE_AFFINITY_ADDR"
ENV_CREDENTIAL_FILE = "TURNSTILE_WORKER_CREDENTIAL_FILE"

#: The substrate's own ``TURNSTILE_*`` settings are not passed on (a runtime
#: must not pick up the substrate's port or database), except these.
_PASSED_SETTINGS = frozenset({"TURNSTILE_LOG_LEVEL", "TURNSTILE_LOG_FORMAT"})

RECORD_FILE = "runtime.json"
CREDENTIAL_FILE = "credential"


@dataclass(frozen=True)
class RuntimeRecord:
    """What the state directory keeps about one running runtime."""

    pid: int
    start_ticks: int
    name: str
    kind: str
    client_label: str | None
    tier: str
    started_at: str
    #: The generation of the runtime's sandbox credential ("" without credentials).
    generation: str = ""

    def runtime(self, sandbox_id: str) -> Runtime:
        return Runtime(
            sandbox_id=sandbox_id,
            name=self.name,
            kind=CreateKind(self.kind),
            client_label=self.client_label,
            tier=self.tier,
        )


def _worker_transport(settings: SubstrateSettings) -> dict[str, str]:
    """How runtimes reach the relay: the sandbox-class certificate, or plaintext
    when this process itself runs plaintext (loopback development)."""
    if settings.plaintext:
        return {"TURNSTILE_WORKER_PLAINTEXT": "true"}
    cert, key = settings.direct_worker_tls_cert_file, settings.direct_worker_tls_key_file
    if cert is None or key is None or settings.tls_ca_file is None:
        raise ValueError(
            "the Direct substrate with mTLS needs TURNSTILE_DIRECT_WORKER_TLS_CERT_FILE and "
            "TURNSTILE_DIRECT_WORKER_TLS_KEY_FILE (the sandbox-class certificate its "
            "runtimes attach with)"
        )
    return {
        "TURNSTILE_WORKER_TLS_CERT_FILE": str(cert.absolute()),
        "TURNSTILE_WORKER_TLS_KEY_FILE": str(key.absolute()),
        "TURNSTILE_WORKER_TLS_CA_FILE": str(settings.tls_ca_file.absolute()),
    }


class DirectSubstrate:
    """Runtimes as host processes, one process group each."""

    name = "direct"

    def __init__(
        self,
        settings: SubstrateSettings,
        credentials: CredentialIssuer | None = None,
        leadership: Leadership | None = None,
        resolver: Resolver | None = None,
    ) -> None:
        """``leadership``: where the credential renewal registers as leader work (the
        process's :class:`~turnstile_platform.leader.LocalLeadership`); None runs it
        as this substrate's own task. ``resolver`` turns each runtime's client into
        its bounded key when the substrate counts its runtimes (required then)."""
        self.command = shlex.split(settings.direct_runtime_command)
        if not self.command:
            raise ValueError("TURNSTILE_DIRECT_RUNTIME_COMMAND must not be empty")
        self.state_dir = settings.direct_state_dir.absolute()
        self.stop_grace_s = settings.direct_stop_grace_s
        self._worker_env = {ENV_AFFINITY_ADDR: settings.affinity_addr}
        #: What each runtime's credential attests it serves (the worker's default is 1).
        self._capacity = settings.direct_worker_capacity or 1
        if settings.direct_worker_capacity is not None:
            self._worker_env[ENV_CAPACITY] = str(settings.direct_worker_capacity)
        self._worker_env.update(_worker_transport(settings))
        self._reaper = processes.Reaper()
        #: Forks runtimes from a process that imported them already (fast wakes).
        self._launcher = (
            Launcher(settings.direct_runtime_preload) if settings.direct_runtime_preload else None
        )
        self._started = False
        self._live: DirectLiveCounts | None = None
        if settings.direct_live_counts == "count":
            if resolver is None:
                raise ValueError("counting live runtimes needs the service's resolver")
            self._live = DirectLiveCounts(
                self._live_runtimes, resolver, chunk=settings.live_counts_chunk
            )
        self.credentials = credentials
        self._renew_interval_s = settings.worker_credential_renew_interval_s
        self._retry_after_s = settings.retry_after_s
        self._renewing: asyncio.Task[None] | None = None
        self._leadership = leadership
        if credentials is not None and leadership is not None:
            leadership.add_work("sandbox-credential-renewal", self._renew_as_leader)

    async def start(self) -> None:
        await asyncio.to_thread(self.state_dir.mkdir, parents=True, exist_ok=True)
        if self._launcher is not None:
            await asyncio.to_thread(self._launcher.start)
        self._started = True
        if self.credentials is not None and self._leadership is None:
            self._renewing = asyncio.create_task(self._renew_forever(self.credentials))

    async def close(self) -> None:
        """Stop watching runtimes; they keep running and are found again on restart."""
        self._started = False
        if self._renewing is not None:
            self._renewing.cancel()
            await asyncio.gather(self._renewing, return_exceptions=True)
        self._reaper.close()
        if self._launcher is not None:
            await asyncio.to_thread(self._launcher.close)

    def ready(self) -> bool:
        return self._started

    def plan(self, spec: RuntimeSpec) -> Plan:
        return Plan(CreateKind.RESTORE if spec.restore else CreateKind.COLD)

    async def find_running(self, sandbox_id: str) -> Runtime | None:
        record = self._running_record(sandbox_id)
        return record.runtime(sandbox_id) if record is not None else None

    async def ensure_runtime(self, spec: RuntimeSpec, plan: Plan, cap_gate: CapGate) -> Runtime:
        """Start the sandbox's process, or return the one already running.

        The cap gate runs before the process is started; if anything fails
        after the start, the process group is stopped before the error is raised.
        """
        running = self._running_record(spec.sandbox_id)
        if running is not None:
            return running.runtime(spec.sandbox_id)
        await cap_gate()
        # Minted (and recorded, so any earlier runtime's credential stops
        # working) before the process exists; a failure after this point ends
        # in stop_runtime, which revokes it.
        issued = None
        if self.credentials is not None:
            try:
                issued = await self.credentials.issue(
                    spec.sandbox_id, presence=self._presence(spec.client_label, spec.tier)
                )
            except UNREACHABLE as error:
                # Nothing started yet: a clean, retryable refusal.
                raise dependency_unavailable("redis", self._retry_after_s) from error
        # The start runs in a thread (fork/exec blocks). If this call is
        # cancelled meanwhile, the thread still finishes: wait for it and stop
        # what it started, so a cancelled activation leaves no process behind.
        starting = asyncio.ensure_future(asyncio.to_thread(self._start, spec, plan.kind, issued))
        try:
            record, child = await asyncio.shield(starting)
        except asyncio.CancelledError:
            await asyncio.wait([starting])
            if not starting.cancelled() and starting.exception() is None:
                self._watch(starting.result()[1])
                await self.stop_runtime(spec.sandbox_id)
            raise
        self._watch(child)
        log.info(
            "runtime started",
            extra={"sandbox_id": spec.sandbox_id, "pid": record.pid, "kind": plan.kind.value},
        )
        self._live_changed()
        return record.runtime(spec.sandbox_id)

    def _watch(self, child: subprocess.Popen[bytes] | None) -> None:
        """Reap our own child; a runtime forked by the launcher is reaped by the kernel."""
        if child is not None:
            self._reaper.watch(child)

    async def stop_runtime(self, sandbox_id: str) -> bool:
        """Revoke the runtime's credential, then SIGTERM its process group and
        SIGKILL it after the grace period.

        The revocation comes first and happens even when no runtime is recorded
        (a start that failed half-way), so a credential never outlives its runtime.
        """
        unrevoked: BaseException | None = None
        if self.credentials is not None:
            self._credential_path(sandbox_id).unlink(missing_ok=True)
            try:
                await self.credentials.revoke(sandbox_id)
            except UNREACHABLE as error:
                # Stop the process all the same; the caller retries the revocation.
                unrevoked = error
        record = self._read_record(sandbox_id)
        stopped = False
        if record is not None:
            stopped = await processes.stop_group(record.pid, record.start_ticks, self.stop_grace_s)
            self._reaper.reap()
            self._drop_record(sandbox_id)
            self._live_changed()
            if stopped:
                log.info("runtime stopped", extra={"sandbox_id": sandbox_id, "pid": record.pid})
        if unrevoked is not None:
            log.warning("could not revoke a stopped runtime's credential: Redis unreachable")
            raise dependency_unavailable("redis", self._retry_after_s) from unrevoked
        return stopped

    def count_live(
        self, key: str, exclude_sandbox_id: str | None, pending: Collection[str]
    ) -> LiveCount | CountUnknown:
        if self._live is None:
            return CountUnknown(
                "unsupported",
                "the Direct substrate does not count live sandboxes "
                "(TURNSTILE_DIRECT_LIVE_COUNTS=unsupported)",
            )
        return self._live.count(key, exclude_sandbox_id, pending)

    def live_counts_work(
        self, store: LiveStore, chunk: int
    ) -> Callable[[LeaderTerm], Awaitable[None]]:
        """Publish the live runtimes by key, or declare that this substrate does not
        count, so the cap admits (SPEC S4)."""
        if self._live is None:
            return functools.partial(declare_unsupported, store)
        return functools.partial(self._live.run, store)

    def _live_changed(self) -> None:
        if self._live is not None:
            self._live.changed()

    def _live_runtimes(self) -> dict[str, str | None]:
        """Every runtime that runs now, with its client label (blocking: a thread)."""
        live: dict[str, str | None] = {}
        for directory in _sandbox_dirs(self.state_dir):
            record = self._read_record(directory.name)
            if record is not None and processes.is_alive(record.pid, record.start_ticks):
                live[directory.name] = record.client_label
        return live

    # -- the state directory -------------------------------------------------

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self.state_dir / sandbox_id

    def workspace(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / "workspace"

    def _record_path(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / RECORD_FILE

    def _credential_path(self, sandbox_id: str) -> Path:
        return self.sandbox_dir(sandbox_id) / CREDENTIAL_FILE

    # -- credential renewal --------------------------------------------------

    async def _renew_as_leader(self, term: LeaderTerm) -> None:
        assert self.credentials is not None
        await self._renew_forever(self.credentials)

    async def _renew_forever(self, credentials: CredentialIssuer) -> None:
        """Every renewal interval, renew what is due; errors are logged, never fatal."""
        while True:
            await asyncio.sleep(self._renew_interval_s)
            try:
                await self.renew_credentials(credentials)
            except Exception:
                log.warning("sandbox credential renewal failed; retrying later", exc_info=True)

    async def renew_credentials(self, credentials: CredentialIssuer) -> int:
        """Re-mint the credentials of this host's running runtimes that are past
        half their ttl; returns how many were renewed. Idempotent."""
        due_before = time.time() - credentials.ttl_ms / 2000
        renewed = 0
        for directory in await asyncio.to_thread(_sandbox_dirs, self.state_dir):
            sandbox_id = directory.name
            record = self._running_record(sandbox_id)
            if record is None or not record.generation:
                continue
            path = self._credential_path(sandbox_id)
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime > due_before:
                    continue
            issued = await credentials.renew(
                sandbox_id,
                record.generation,
                presence=self._presence(record.client_label, record.tier),
            )
            if issued is None:
                log.warning(
                    "a running runtime's credential was revoked; not renewed",
                    extra={"sandbox_id": sandbox_id},
                )
                continue
            write_private_file(path, issued.credential.encode())
            renewed += 1
        if renewed:
            log.info("renewed sandbox credentials", extra={"renewed": renewed})
        return renewed

    def _presence(self, client_label: str | None, tier: str) -> PresenceClaims:
        """What a runtime's credential attests (SPEC O3); Direct assigns no endpoint."""
        return PresenceClaims(
            owner=client_label or "", tier=tier, capacity=self._capacity, endpoint=""
        )

    def _read_record(self, sandbox_id: str) -> RuntimeRecord | None:
        try:
            raw = self._record_path(sandbox_id).read_text()
        except FileNotFoundError:
            return None
        try:
            return RuntimeRecord(**json.loads(raw))
        except (ValueError, TypeError):
            log.warning("unreadable runtime record dropped", extra={"sandbox_id": sandbox_id})
            self._drop_record(sandbox_id)
            return None

    def _running_record(self, sandbox_id: str) -> RuntimeRecord | None:
        """The sandbox's runtime record if its process still runs; a stale one is dropped."""
        self._reaper.reap()
        record = self._read_record(sandbox_id)
        if record is None:
            return None
        if processes.is_alive(record.pid, record.start_ticks):
            return record
        # The leader died (or its pid was reused): forget it, and sweep what it
        # left in its group.
        processes.sweep_orphans(record.pid)
        self._drop_record(sandbox_id)
        return None

    def _drop_record(self, sandbox_id: str) -> None:
        self._record_path(sandbox_id).unlink(missing_ok=True)

    def _write_record(self, sandbox_id: str, record: RuntimeRecord) -> None:
        path = self._record_path(sandbox_id)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(asdict(record)))
        os.replace(temporary, path)

    def _environment(self, spec: RuntimeSpec, issued: Issued | None) -> Mapping[str, str]:
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith("TURNSTILE_") or name in _PASSED_SETTINGS
        }
        env.update(self._worker_env)
        env[ENV_SANDBOX_ID] = spec.sandbox_id
        # Always set: the sandbox's tier as Activate resolved it (an empty request
        # is the default tier; with no tiers configured it stays empty and the worker
        # sends no label, SPEC T1/T6), never the worker kind's own default.
        env[ENV_TIER] = spec.tier
        if issued is not None:
            env[ENV_CREDENTIAL_FILE] = str(self._credential_path(spec.sandbox_id))
        return env

    def _start(
        self, spec: RuntimeSpec, kind: CreateKind, issued: Issued | None
    ) -> tuple[RuntimeRecord, subprocess.Popen[bytes] | None]:
        """Blocking part of a start (runs in a thread): workspace, spawn, record.

        The runtime is forked by the launcher when there is one that works, or
        else started from the command (then it is our child, returned for reaping).
        """
        directory = self.sandbox_dir(spec.sandbox_id)
        workspace = self.workspace(spec.sandbox_id)
        if kind is not CreateKind.RESTORE and workspace.exists():
            shutil.rmtree(workspace)  # a cold start begins from nothing
        workspace.mkdir(parents=True, exist_ok=True)
        if issued is not None:
            write_private_file(self._credential_path(spec.sandbox_id), issued.credential.encode())
        env = self._environment(spec, issued)
        log_path = directory / "runtime.log"
        child: subprocess.Popen[bytes] | None = None
        pid = None
        if self._launcher is not None:
            pid = self._launcher.spawn(env, workspace, log_path, self.command[0])
        if pid is None:
            child = processes.spawn(self.command, env=env, cwd=workspace, log_path=log_path)
            pid = child.pid
        try:
            ticks = processes.start_ticks(pid)
            if ticks is None:
                status = child.wait() if child is not None else "unknown"
                raise RuntimeError(f"runtime exited at once with status {status}")
            record = RuntimeRecord(
                pid=pid,
                start_ticks=ticks,
                name=f"proc-{pid}",
                kind=kind.value,
                client_label=spec.client_label,
                tier=spec.tier,
                started_at=datetime.now(UTC).isoformat(),
                generation=issued.generation if issued is not None else "",
            )
            self._write_record(spec.sandbox_id, record)
        except BaseException:
            processes.signal_group(pid, signal.SIGKILL)
            if child is not None:
                child.wait()
            raise
        return record, child


def _sandbox_dirs(state_dir: Path) -> list[Path]:
    """The sandbox directories holding a runtime record (blocking: run in a thread)."""
    return [path.parent for path in state_dir.glob(f"*/{RECORD_FILE}")]
