"""The Direct substrate: each sandbox's runtime is a process on this host.

The runtime (the worker agent by default) starts in the sandbox's workspace
directory: fresh on a cold start, kept on a restore (that is what is restored);
with ``direct_runtime_preload`` it is forked from a launcher that imported it once
(:mod:`.launcher`), so a woken session does not wait for an interpreter's start.

The processes are this host's, so this host's files, not the database, say which
exist: a runtime record per sandbox in the state directory. A runtime runs only
while its pid still names the process started at the recorded time, so after a
restart :meth:`DirectSubstrate.find_running` adopts the runtimes that outlived
the substrate, and a dead or reused pid is never signalled. Runtimes hold no
secrets (SPEC O4): an allowlisted environment and, as root, a uid of their own.
Each start mints a sandbox credential (SPEC Z3) when a signing key is configured;
live counts (SPEC S4) are published only with ``TURNSTILE_DIRECT_LIVE_COUNTS=count``.

Details (the state directory's layout and modes, stop and sweep, credential
renewal) are in docs/substrate.md (Direct substrate) and docs/security.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from turnstile_clientkeys import Resolver
from turnstile_clientkeys.live_store import LiveStore
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DEPENDENCY_ERRORS
from turnstile_platform.leader import Leadership, LeaderTerm
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    Issued,
    PresenceClaims,
    write_private_file,
)
from turnstile_platform.settings import SettingsError
from turnstile_substrate.direct import processes
from turnstile_substrate.direct.environment import (
    base_environment,
    parse_names,
    runtime_environment,
)
from turnstile_substrate.direct.launcher import Launcher
from turnstile_substrate.direct.live_counts import DirectLiveCounts, declare_unsupported
from turnstile_substrate.direct.runtime_users import Identity, RuntimeUsers
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
ENV_AFFINITY_SPIFFE_ID = "TURNSTILE_AFFINITY_SPIFFE_ID"
ENV_CREDENTIAL_FILE = "TURNSTILE_WORKER_CREDENTIAL_FILE"

RECORD_FILE = "runtime.json"
CREDENTIAL_FILE = "credential"
#: The runtimes' copy of the sandbox-class TLS files, under the state directory.
WORKER_TLS_DIR = "worker-tls"
_WORKER_TLS_FILES = ("tls.crt", "tls.key", "ca.crt")


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
    #: The uid and gid it runs as (None: the substrate's own).
    uid: int | None = None
    gid: int | None = None

    def runtime(self, sandbox_id: str) -> Runtime:
        return Runtime(
            sandbox_id=sandbox_id,
            name=self.name,
            kind=CreateKind(self.kind),
            client_label=self.client_label,
            tier=self.tier,
        )


_TLS_ENV = (
    "TURNSTILE_WORKER_TLS_CERT_FILE",
    "TURNSTILE_WORKER_TLS_KEY_FILE",
    "TURNSTILE_WORKER_TLS_CA_FILE",
)


def _worker_tls_sources(settings: SubstrateSettings) -> tuple[Path, Path, Path] | None:
    """The sandbox-class certificate, key and CA bundle runtimes attach with, or
    None when this process itself runs plaintext (loopback development)."""
    if settings.plaintext:
        return None
    cert, key = settings.direct_worker_tls_cert_file, settings.direct_worker_tls_key_file
    if cert is None or key is None or settings.tls_ca_file is None:
        raise SettingsError(
            "the Direct substrate with mTLS needs TURNSTILE_DIRECT_WORKER_TLS_CERT_FILE and "
            "TURNSTILE_DIRECT_WORKER_TLS_KEY_FILE (the sandbox-class certificate its "
            "runtimes attach with)"
        )
    return cert.absolute(), key.absolute(), settings.tls_ca_file.absolute()


def _share_worker_tls(sources: tuple[Path, Path, Path], directory: Path, group: int) -> None:
    """Copy the sandbox-class TLS files where the runtimes' group may read them
    (0640 in a 0750 directory, owned by this process's user); a file already the
    same is left alone, a changed one (rotated) replaced atomically. Blocking."""
    directory.mkdir(mode=0o750, exist_ok=True)
    os.chown(directory, -1, group)
    os.chmod(directory, 0o750)  # noqa: S103 - the runtimes' group reads the sandbox-class files
    for source, name in zip(sources, _WORKER_TLS_FILES, strict=True):
        data = source.read_bytes()
        target = directory / name
        with contextlib.suppress(FileNotFoundError):
            if target.read_bytes() == data:
                continue
        temporary = directory / f".{name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            os.fchown(file.fileno(), -1, group)
            os.fchmod(file.fileno(), 0o640)
            file.write(data)
        os.replace(temporary, target)


def _chown_tree(root: Path, identity: Identity) -> None:
    """Give a restored workspace to the uid its new runtime runs as (blocking)."""
    os.chown(root, identity.uid, identity.gid)
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.lchown(os.path.join(directory, name), identity.uid, identity.gid)


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
            raise SettingsError("TURNSTILE_DIRECT_RUNTIME_COMMAND must not be empty")
        self.state_dir = settings.direct_state_dir.absolute()
        self.stop_grace_s = settings.direct_stop_grace_s
        self._env_allow = parse_names(settings.direct_runtime_env_allow)
        #: Who runtimes run as (SPEC O4); refuses a root substrate with no setting.
        # A uid is cleared before it is handed out: one round (normally nothing runs
        # as it; stopping a runtime already swept its uid, two rounds).
        self.users = RuntimeUsers.from_settings(
            settings.direct_runtime_user,
            settings.direct_runtime_uids,
            functools.partial(processes.kill_as, rounds=1),
        )
        self._worker_env = {
            ENV_AFFINITY_ADDR: settings.affinity_addr,
            # The relay's identity the worker must find before it attaches (SPEC O5).
            ENV_AFFINITY_SPIFFE_ID: settings.affinity_spiffe_id,
        }
        #: What each runtime's credential attests it serves (the worker's default is 1).
        self._capacity = settings.direct_worker_capacity or 1
        if settings.direct_worker_capacity is not None:
            self._worker_env[ENV_CAPACITY] = str(settings.direct_worker_capacity)
        self._worker_tls = _worker_tls_sources(settings)
        self._tls_lock = threading.Lock()
        if self._worker_tls is None:
            self._worker_env["TURNSTILE_WORKER_PLAINTEXT"] = "true"
        elif self.users.group is not None:  # the runtimes' readable copy
            copies = (self.state_dir / WORKER_TLS_DIR / name for name in _WORKER_TLS_FILES)
            self._worker_env.update(zip(_TLS_ENV, map(str, copies), strict=True))
        else:
            self._worker_env.update(zip(_TLS_ENV, map(str, self._worker_tls), strict=True))
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
        # Without a leader elector (one replica) this replica renews credentials.
        self._renewing = BackgroundTasks("direct substrate credential renewal")
        self._leadership = leadership
        if credentials is not None and leadership is not None:
            leadership.add_work("sandbox-credential-renewal", self._renew_as_leader)

    async def start(self) -> None:
        await asyncio.to_thread(self._prepare_state_dir)
        if self._launcher is not None:
            await asyncio.to_thread(
                self._launcher.start, base_environment(os.environ, self._env_allow)
            )
        self._started = True
        if self.credentials is not None and self._leadership is None:
            self._renewing.spawn(
                self._renew_forever(self.credentials), name="sandbox-credential-renewal"
            )

    async def close(self) -> None:
        """Stop watching runtimes; they keep running and are found again on restart."""
        self._started = False
        await self._renewing.close()
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
        # A failing Redis here is a clean, retryable refusal: nothing started yet.
        issued = None
        if self.credentials is not None:
            issued = await self.credentials.issue(
                spec.sandbox_id, presence=self._presence(spec.client_label, spec.tier)
            )
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
            except DEPENDENCY_ERRORS as error:
                # Stop the process all the same; the caller retries the revocation.
                unrevoked = error
        record = self._read_record(sandbox_id)
        stopped = False
        if record is not None:
            stopped = await processes.stop_group(record.pid, record.start_ticks, self.stop_grace_s)
            await asyncio.to_thread(self._end_uid, sandbox_id, record)
            self._reaper.reap()
            self._drop_record(sandbox_id)
            self._live_changed()
            if stopped:
                log.info("runtime stopped", extra={"sandbox_id": sandbox_id, "pid": record.pid})
        if unrevoked is not None:
            log.warning("could not revoke a stopped runtime's credential: %s", unrevoked)
            raise unrevoked
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

    def key_set_changed(self) -> None:
        """Publish the runtimes again now: a client given a key of its own (``keys
        allow``) takes its live runtimes to that key, so its cap counts them at once
        rather than at the next renewal."""
        self._live_changed()

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

    def _prepare_state_dir(self) -> None:
        """Create the state directory: traversable (not listable) by runtimes of
        another uid, which must reach their own files in it; else private."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o711 if self.users.switching else 0o700)
        self._adopt_uids()
        if self.users.switching:
            for parent in self.state_dir.parents:
                if not parent.stat().st_mode & 0o001:
                    raise ValueError(
                        f"runtimes run as another uid and cannot reach the state directory: "
                        f"{parent} is not searchable by others (chmod o+x, or move "
                        "TURNSTILE_DIRECT_STATE_DIR)"
                    )
        self._refresh_worker_tls()

    def _refresh_worker_tls(self) -> None:
        if self._worker_tls is not None and self.users.group is not None:
            with self._tls_lock:  # starts run in threads, side by side
                directory = self.state_dir / WORKER_TLS_DIR
                _share_worker_tls(self._worker_tls, directory, self.users.group)

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
        await asyncio.to_thread(self._refresh_worker_tls)  # a rotated sandbox-class cert
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
            write_private_file(path, issued.credential.encode(), _owner(record.uid, record.gid))
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
        # left in its group, and under a uid of its own whatever else runs as it.
        processes.sweep_orphans(record.pid)
        self._end_uid(sandbox_id, record)
        self._drop_record(sandbox_id)
        return None

    def _end_uid(self, sandbox_id: str, record: RuntimeRecord) -> None:
        """A runtime of a uid of its own has ended: whatever still runs as that uid
        escaped its process group (``setsid``, a double fork) and goes too, and the
        uid is free for another runtime. Blocking."""
        if self.users.exclusive(record.uid):
            assert record.uid is not None
            assert record.gid is not None
            processes.kill_as(record.uid, record.gid)
            self._close_sandbox_dir(sandbox_id)
            self.users.unbind(sandbox_id)

    def _close_sandbox_dir(self, sandbox_id: str) -> None:
        """Make a stopped sandbox's directory the substrate's alone (0700), before its
        uid is free: the workspace keeps that uid's ownership, and the next runtime
        handed the uid (another tenant's sandbox) must not reach it. A start opens the
        directory again (0711) once the workspace is its runtime's. Blocking."""
        with contextlib.suppress(FileNotFoundError):
            os.chmod(self.sandbox_dir(sandbox_id), 0o700)

    def _adopt_uids(self) -> None:
        """After a restart: the runtimes still running hold their uids. Blocking."""
        for directory in _sandbox_dirs(self.state_dir):
            record = self._read_record(directory.name)
            if record is not None and processes.is_alive(record.pid, record.start_ticks):
                self.users.adopt(directory.name, record.uid)
            elif self.users.uids is not None:
                self._close_sandbox_dir(directory.name)  # stopped before this start

    def _drop_record(self, sandbox_id: str) -> None:
        self._record_path(sandbox_id).unlink(missing_ok=True)

    def _write_record(self, sandbox_id: str, record: RuntimeRecord) -> None:
        write_private_file(self._record_path(sandbox_id), json.dumps(asdict(record)).encode())

    def _environment(self, spec: RuntimeSpec, issued: Issued | None) -> Mapping[str, str]:
        """The runtime's whole environment: the allowlist and its worker settings."""
        worker = dict(self._worker_env)
        worker[ENV_SANDBOX_ID] = spec.sandbox_id
        # Always set: the sandbox's tier as Activate resolved it (an empty request
        # is the default tier; with no tiers configured it stays empty and the worker
        # sends no label, SPEC T1/T6), never the worker kind's own default.
        worker[ENV_TIER] = spec.tier
        if issued is not None:
            worker[ENV_CREDENTIAL_FILE] = str(self._credential_path(spec.sandbox_id))
        home = str(self.workspace(spec.sandbox_id))
        return runtime_environment(os.environ, self._env_allow, home, worker)

    def _make_dirs(self, spec: RuntimeSpec, kind: CreateKind, identity: Identity | None) -> None:
        """The sandbox directory (the substrate's) and its workspace (the runtime's
        uid's, 0700; a restored one is given to the new uid if it changed)."""
        directory = self.sandbox_dir(spec.sandbox_id)
        workspace = self.workspace(spec.sandbox_id)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Closed while the workspace changes hands: no other uid reaches it meanwhile.
        os.chmod(directory, 0o700)
        if kind is not CreateKind.RESTORE and workspace.exists():
            shutil.rmtree(workspace)  # a cold start begins from nothing
        workspace.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(workspace, 0o700)
        if identity is not None and workspace.stat().st_uid != identity.uid:
            _chown_tree(workspace, identity)
        if identity is not None:
            os.chmod(directory, 0o711)  # noqa: S103 - its runtime traverses to its own files

    def _start(
        self, spec: RuntimeSpec, kind: CreateKind, issued: Issued | None
    ) -> tuple[RuntimeRecord, subprocess.Popen[bytes] | None]:
        """Blocking part of a start (runs in a thread): workspace, spawn, record.

        The runtime is forked by the launcher when there is one that works, or
        else started from the command (then it is our child, returned for reaping).
        """
        workspace = self.workspace(spec.sandbox_id)
        preferred = None
        with contextlib.suppress(FileNotFoundError):
            preferred = workspace.stat().st_uid  # a restore keeps its uid when it can
        identity = self.users.acquire(preferred)
        try:
            pid, child = self._spawn(spec, kind, issued, identity)
        except BaseException:
            self.users.release(identity)
            raise
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
                uid=identity.uid if identity is not None else None,
                gid=identity.gid if identity is not None else None,
            )
            self._write_record(spec.sandbox_id, record)
        except BaseException:
            processes.signal_group(pid, signal.SIGKILL)
            if child is not None:
                child.wait()
            self.users.release(identity)
            raise
        self.users.bind(spec.sandbox_id, identity)
        return record, child

    def _spawn(
        self, spec: RuntimeSpec, kind: CreateKind, issued: Issued | None, identity: Identity | None
    ) -> tuple[int, subprocess.Popen[bytes] | None]:
        """Lay out the files, then fork (launcher) or exec (command) the runtime."""
        self._make_dirs(spec, kind, identity)
        self._refresh_worker_tls()
        owner = (identity.uid, identity.gid) if identity is not None else None
        if issued is not None:
            path = self._credential_path(spec.sandbox_id)
            write_private_file(path, issued.credential.encode(), owner)
        env = self._environment(spec, issued)
        workspace = self.workspace(spec.sandbox_id)
        log_path = self.sandbox_dir(spec.sandbox_id) / "runtime.log"
        uid, gid = owner if owner is not None else (None, None)
        if self._launcher is not None:
            pid = self._launcher.spawn(env, workspace, log_path, self.command[0], uid, gid)
            if pid is not None:
                return pid, None
        child = processes.spawn(
            self.command, env=env, cwd=workspace, log_path=log_path, user=uid, group=gid
        )
        return child.pid, child


def _owner(uid: int | None, gid: int | None) -> tuple[int, int] | None:
    return (uid, gid) if uid is not None and gid is not None else None


def _sandbox_dirs(state_dir: Path) -> list[Path]:
    """The sandbox directories holding a runtime record (blocking: run in a thread)."""
    return [path.parent for path in state_dir.glob(f"*/{RECORD_FILE}")]
