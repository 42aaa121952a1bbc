"""A preloaded launcher: runtimes forked from a process that has imported them already.

Why: a woken sandbox waits for its runtime to start, and the worker agent's
imports take 0.5 s idle and over a second under load, most of the wake
(``services/affinity/bench/bench_wake.py``); a process that imported them once
forks a runtime in milliseconds.

The launcher is a child of the substrate talking over a socket pair: one JSON
line per request (environment, directory, log, uid and gid), one line back with
the pid once the child has set itself up exactly as
:func:`~turnstile_substrate.direct.processes.spawn` would (so its process group
exists when the substrate learns the pid). It never runs an event loop or a
thread, so forking it is safe; the kernel reaps its children. It runs with the
runtimes' allowlisted environment, never the substrate's, and holds no secret
(SPEC O4): a forked child's ``/proc/<pid>/environ`` is the launcher's. This module
imports only the standard library, so :class:`Launcher` costs nothing to load.
docs/substrate.md ("Preloaded runtimes") describes it for operators.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

#: Longest wait for one answer (the first one waits for the preload's imports).
ANSWER_TIMEOUT_S = 60.0


class Launcher:
    """The substrate's side: starts the launcher process and asks it for runtimes.

    Blocking: call :meth:`spawn` from a thread, like
    :func:`~turnstile_substrate.direct.processes.spawn`. Any failure of the
    launcher (it could not import the target, died, or stopped answering) makes
    :meth:`spawn` return None and the launcher is not asked again: the caller
    then starts the runtime from its command.
    """

    def __init__(self, target: str) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: socket.socket | None = None
        self._reader: BinaryIO | None = None

    def start(self, env: Mapping[str, str]) -> None:
        """Start the launcher process with ``env`` (the runtimes' allowlisted base,
        never the substrate's environment); it imports the target in the background."""
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, self.target, str(theirs.fileno())],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                close_fds=True,
            )
        except OSError:
            ours.close()
            log.warning("the runtime launcher did not start", exc_info=True)
            return
        finally:
            theirs.close()
        ours.settimeout(ANSWER_TIMEOUT_S)
        self._socket = ours
        self._reader = ours.makefile("rb")

    def spawn(
        self,
        env: Mapping[str, str],
        cwd: Path,
        log_path: Path,
        argv0: str,
        user: int | None = None,
        group: int | None = None,
    ) -> int | None:
        """Fork a runtime (as ``user``/``group`` when given); its pid, or None when
        the launcher cannot (see the class)."""
        with self._lock:
            if self._socket is None or self._reader is None:
                return None
            request = {
                "env": dict(env),
                "cwd": str(cwd),
                "log": str(log_path),
                "argv0": argv0,
                "uid": user,
                "gid": group,
            }
            try:
                self._socket.sendall(json.dumps(request).encode() + b"\n")
                line = self._reader.readline()
                answer = json.loads(line) if line else {"error": "the launcher exited"}
            except (OSError, ValueError) as error:
                answer = {"error": f"the launcher failed: {error}"}
            pid = answer.get("pid")
            if isinstance(pid, int):
                return pid
            if answer.get("setup"):  # this runtime could not be set up; the launcher is fine
                raise RuntimeError(f"runtime set-up failed: {answer['error']}")
            log.warning(
                "the runtime launcher is unavailable; starting runtimes from the command",
                extra={"detail": str(answer.get("error"))},
            )
            self._close_locked()
            return None

    def close(self) -> None:
        """Close the socket (the launcher then exits) and reap the launcher."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        # The file object holds the socket open too: close both, so the launcher sees EOF.
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


# -- the launcher process ---------------------------------------------------------


def serve(target: str, fd: int) -> int:
    """Import ``target`` (``module:function``), then fork a runtime per request."""
    module_name, _, function_name = target.partition(":")
    entry = getattr(importlib.import_module(module_name), function_name)
    # Ctrl-C at a terminal reaches the whole process group; the launcher ends
    # when the substrate does (EOF), and never leaves zombies.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    with socket.socket(fileno=fd) as channel, channel.makefile("rwb") as stream:
        for line in stream:
            request = json.loads(line)
            try:
                answer: dict[str, object] = {"pid": _fork(entry, request, channel)}
            except _SetupError as error:
                answer = {"error": str(error), "setup": True}
            except OSError as error:
                answer = {"error": f"fork failed: {error}"}
            stream.write(json.dumps(answer).encode() + b"\n")
            stream.flush()
    return 0


class _SetupError(Exception):
    """The child could not set itself up as a runtime (working directory, log file)."""


def _fork(entry: Callable[[], object], request: dict[str, object], channel: socket.socket) -> int:
    """Fork a child that runs ``entry``; its pid once it is set up."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(ready_r)
        channel.close()
        _run_child(entry, request, ready_w)
    os.close(ready_w)
    with os.fdopen(ready_r, "rb") as ready:
        report = ready.read()
    if report:
        raise _SetupError(report.decode(errors="replace"))
    return pid


def _run_child(entry: Callable[[], object], request: dict[str, object], ready_w: int) -> None:
    code = 1
    try:
        try:
            os.setsid()
            os.chdir(str(request["cwd"]))
            out = os.open(str(request["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            null = os.open(os.devnull, os.O_RDONLY)
            _become(request.get("uid"), request.get("gid"))
        except OSError as error:
            os.write(ready_w, str(error).encode())
            os._exit(1)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, ready_w)
        os.closerange(ready_w + 1, os.sysconf("SC_OPEN_MAX"))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        sys.argv = [str(request["argv0"])]
        os.close(ready_w)  # set up: the launcher may answer with our pid
        entry()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _become(uid: object, gid: object) -> None:
    """Drop to the runtime's uid and gid, with no supplementary groups.

    What ``subprocess.Popen(user=, group=, extra_groups=[])`` does in its child
    before exec, in the same order (groups, gid, then uid: after the uid no other
    change is allowed); a forked child has no exec to do it for it. Set-up
    (working directory, log) is done before, as the substrate's user, like
    subprocess does. An error fails the set-up: the runtime never runs as the
    launcher's uid by accident.
    """
    if uid is None:
        return
    assert isinstance(uid, int)
    assert isinstance(gid, int)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:  # belt and braces: never stay privileged
        raise PermissionError(f"could not become uid {uid}")


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], int(sys.argv[2])))
