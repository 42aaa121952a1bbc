"""Host processes as runtimes: spawn in their own process group, identify, wait, stop.

A process is identified by its pid *and* its start time (``/proc/<pid>/stat``
field 22, clock ticks since boot), so a pid the kernel reused for an unrelated
process is never mistaken for a runtime, nor signalled. Exits are awaited
through a pidfd (Linux ≥ 5.3), which works for processes this service did not
start (runtimes adopted after a restart) and needs no polling; elsewhere a
short poll stands in.

Each runtime leads its own session and process group, so stopping it signals
everything it started too: no orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from typing import IO

_POLL_INTERVAL_S = 0.02


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it is not
    alive (gone, or a zombie that has exited but not been reaped).

    Off Linux (no ``/proc``) a live process reports 0: identity then rests on
    the pid alone.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return _alive_without_proc(pid)
    # The command name (field 2) is in parentheses and may hold spaces or ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    state, ticks = fields[0], fields[19]
    if state in (b"Z", b"X"):
        return None
    return int(ticks)


def _alive_without_proc(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return 0
    return 0


def is_alive(pid: int, ticks: int) -> bool:
    """Whether ``pid`` still is the process that started at ``ticks``."""
    current = start_ticks(pid)
    return current is not None and (current == ticks or current == 0 or ticks == 0)


def sweep_orphans(pid: int) -> None:
    """SIGKILL what a dead runtime left in its process group.

    Only when no process holds the pid any more (or only its zombie): Linux
    does not reuse a pid while a process group still carries its number, so
    the group is then certainly the runtime's. A pid already reused by another
    process is left alone.
    """
    if start_ticks(pid) is None:
        signal_group(pid, signal.SIGKILL)


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
    user: int | None = None,
    group: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new session and process group.

    Blocking (vfork/exec): call it from a thread. Output goes to ``log_path``
    (opened here, by the substrate: created 0600). With ``user``/``group`` the
    process runs as them, with no supplementary groups, by way of
    :mod:`.become` (:func:`spawn_as`), so nothing of gRPC runs between the
    substrate's fork and the command's exec.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as log:
        if user is not None:
            if group is None:
                raise ValueError("a runtime run as a uid needs its gid too")
            return spawn_as(argv, env=env, cwd=cwd, user=user, group=group, output=log)
        # No uid change and no preexec_fn: CPython starts it with vfork(), which runs
        # no fork handler (gRPC's abort in a forked child of a threaded process).
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )


def spawn_as(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    user: int,
    group: int,
    output: IO[bytes] | int,
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as ``user``/``group`` (no supplementary groups) without a
    ``fork()`` of this process: :mod:`.become`, started with vfork() as root in an
    empty environment, drops to the ids and execs the command (blocking).

    ``subprocess.Popen(user=…)`` forks (CPython's vfork() is only for a child that
    changes no ids), and in a fork of the substrate's threaded gRPC process gRPC's
    fork handlers can abort the child before its exec. Errors are the ones Popen
    raises: a command not found, or a failed uid change, is an ``OSError`` here,
    never a runtime that exits at once.
    """
    executable = _resolve(argv[0], env)
    helper = [sys.executable, "-I", "-S", str(_BECOME)]
    payload = json.dumps(dict(env)).encode()
    env_r, env_w = os.pipe()
    ready_r, ready_w = os.pipe()
    try:
        try:
            child = subprocess.Popen(
                [*helper, str(env_r), str(ready_w), str(user), str(group), executable, *argv],
                env={},
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=new_session,
                close_fds=True,
                pass_fds=(env_r, ready_w),
            )
        finally:
            os.close(env_r)
            os.close(ready_w)
        # A helper that failed before reading closes the pipe: its report says why.
        with contextlib.suppress(BrokenPipeError), open(env_w, "wb", closefd=False) as sink:
            sink.write(payload)
        os.close(env_w)
        env_w = -1  # the helper reads EOF: the environment is whole
        with open(ready_r, "rb", closefd=False) as ready:
            report = ready.read()  # EOF at the command's exec
    finally:
        if env_w >= 0:
            os.close(env_w)
        os.close(ready_r)
    if report:
        child.wait()
        number, _, message = report.decode(errors="replace").partition(":")
        if number.isdigit() and int(number):
            raise OSError(int(number), message, argv[0])
        raise OSError(f"starting {argv[0]} as uid {user} failed: {message}")
    return child


#: The uid-changing step of :func:`spawn_as`, run by path (it imports only the stdlib).
_BECOME = Path(__file__).with_name("become.py")


def _resolve(command: str, env: Mapping[str, str]) -> str:
    """The file ``command`` names, looked up on the environment's ``PATH`` as
    Popen does; ``FileNotFoundError`` when there is none."""
    if os.path.dirname(command):
        return command
    found = shutil.which(command, path=env.get("PATH", os.defpath))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), command)
    return found


def _uids(pid: str) -> set[int] | None:
    """The real, effective, saved and filesystem uids of a live process, or None
    (gone, a zombie, or not readable)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    uids: set[int] | None = None
    for line in status.splitlines():
        if line.startswith("State:") and line.split()[1] in ("Z", "X"):
            return None
        if line.startswith("Uid:"):
            uids = {int(field) for field in line.split()[1:]}
    return uids


def _may_run_as(entry: os.DirEntry[str], uid: int) -> bool:
    """Whether the process of ``/proc/<pid>`` may run as ``uid``: its directory is
    owned by that uid or by root (see :func:`live_uids`); a cheap filter."""
    try:
        return entry.stat().st_uid in (0, uid)
    except OSError:
        return False


def live_uids(among: Container[int] | None = None) -> set[int]:
    """Every uid some live process of this host runs as, or only those ``among``
    (blocking: reads /proc).

    With ``among``, a process's status (what costs: ~50 µs each) is read only when
    its ``/proc/<pid>`` is owned by one of them or by root: the directory belongs to
    the process's effective uid, or to root when it is not dumpable (after a uid
    change without exec, or by its own choice), so no process of those uids is missed.
    """
    held: set[int] = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        if among is not None:
            try:
                owner = entry.stat().st_uid
            except OSError:
                continue
            if owner != 0 and owner not in among:
                continue
        held |= _uids(entry.name) or set()
    return held if among is None else {uid for uid in held if uid in among}


def kill_user(uid: int, *, rounds: int = 20) -> int:
    """SIGKILL every live process running as ``uid``; how many were signalled.

    For a uid that belongs to one runtime alone: it sweeps what escaped the
    runtime's process group (a double fork, ``setsid``) as well. Repeated until no
    process holds the uid, since one may fork while it is being killed (bounded
    by ``rounds``). Blocking: reads /proc.
    """
    signalled = 0
    for _ in range(rounds):
        pids = [
            int(entry.name)
            for entry in os.scandir("/proc")
            if entry.name.isdigit() and _may_run_as(entry, uid) and uid in (_uids(entry.name) or ())
        ]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                signalled += 1
    return signalled


#: ``kill``, run as a runtime's uid by :func:`kill_as` (procps, util-linux and
#: BusyBox all read ``-9 -1`` as "SIGKILL to every process I may signal").
_KILL = shutil.which("kill", path="/usr/bin:/bin")


def kill_as(uid: int, gid: int, *, rounds: int = 2) -> None:
    """SIGKILL every process of ``uid`` as the kernel counts them (blocking).

    A helper runs as ``uid`` and calls ``kill(-1, SIGKILL)``, which reaches exactly
    the processes it may signal: those whose real or saved uid is ``uid``, whatever
    they did to their process group, session or dumpable flag. One exec (a few
    milliseconds), where scanning /proc costs ~50 µs a process of the host. A second
    round catches a process forked while the first ran. For a uid that belongs to one
    runtime alone (never a shared one: it would kill the others' processes too).
    Without a ``kill`` binary, :func:`kill_user` scans instead.
    """
    if _KILL is None:
        kill_user(uid)
        return
    for _ in range(rounds):
        helper = spawn_as(
            [_KILL, "-9", "-1"],
            env={},
            cwd=Path("/"),
            user=uid,
            group=gid,
            output=subprocess.DEVNULL,
            new_session=False,
        )
        helper.wait(timeout=30)


def _pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``; None when unsupported; ProcessLookupError when gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        fd: int = opener(pid)
    except OSError as error:
        if isinstance(error, ProcessLookupError):
            raise
        return None
    return fd


async def wait_exit(pid: int, ticks: int, timeout_s: float) -> bool:
    """Wait until the process exits; True if it did within ``timeout_s``."""
    if not is_alive(pid, ticks):
        return True
    try:
        fd = _pidfd(pid)
    except ProcessLookupError:
        return True
    if fd is None:
        return await _poll_exit(pid, ticks, timeout_s)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, readable)
    try:
        if not is_alive(pid, ticks):  # it may have exited before the reader was added
            return True
        async with asyncio.timeout(timeout_s):
            await exited
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def _poll_exit(pid: int, ticks: int, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while is_alive(pid, ticks):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(_POLL_INTERVAL_S)
    return True


def signal_group(pgid: int, sig: signal.Signals) -> bool:
    """Send ``sig`` to the process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    return True


async def stop_group(pid: int, ticks: int, grace_s: float) -> bool:
    """Stop a runtime and everything in its process group.

    SIGTERM to the group; once the leader exits, or after ``grace_s``, SIGKILL
    to the group sweeps anything left (a child that ignored SIGTERM, or a
    leader that did). Returns False if the runtime was not running.
    """
    if not is_alive(pid, ticks):
        sweep_orphans(pid)
        return False
    signal_group(pid, signal.SIGTERM)
    exited = await wait_exit(pid, ticks, grace_s)
    signal_group(pid, signal.SIGKILL)
    if not exited:
        await wait_exit(pid, ticks, max(grace_s, 5.0))
    return True


class Reaper:
    """Reaps this service's own runtime processes as they exit (no zombies),
    driven by a pidfd per child instead of a thread or SIGCHLD handler."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[subprocess.Popen[bytes], int]] = {}
        #: Children without a pidfd (old kernels): reaped when :meth:`reap` is called.
        self._polled: dict[int, subprocess.Popen[bytes]] = {}

    def watch(self, child: subprocess.Popen[bytes]) -> None:
        try:
            fd = _pidfd(child.pid)
        except ProcessLookupError:
            child.poll()
            return
        if fd is None:
            self._polled[child.pid] = child
            return
        self._watched[child.pid] = (child, fd)
        asyncio.get_running_loop().add_reader(fd, self._reap, child.pid)

    def reap(self) -> None:
        """Reap the children without a pidfd that have exited (a no-op with pidfds)."""
        for pid, child in list(self._polled.items()):
            if child.poll() is not None:
                del self._polled[pid]

    def _reap(self, pid: int) -> None:
        watched = self._watched.pop(pid, None)
        if watched is None:
            return
        child, fd = watched
        asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)
        child.poll()

    def close(self) -> None:
        """Stop watching; children that still run are left running (and are
        reaped by whoever inherits them)."""
        loop = asyncio.get_running_loop()
        for child, fd in self._watched.values():
            loop.remove_reader(fd)
            os.close(fd)
            child.poll()
        for child in self._polled.values():
            child.poll()
        self._watched.clear()
        self._polled.clear()
