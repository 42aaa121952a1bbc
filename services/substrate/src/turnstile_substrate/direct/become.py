"""Exec a command as a runtime's uid: the step between the substrate and a runtime.

Why a program of its own: ``subprocess.Popen(user=…)`` starts its child with
``fork()`` (CPython uses ``vfork()`` only for a child that changes no ids), and a
fork of the substrate's multi-threaded gRPC process runs gRPC's fork handlers in
that child, which can abort there before the exec ("Check failed:
next_worker->initialized_cv", the runtime gone with status -6).
:func:`~turnstile_substrate.direct.processes.spawn` starts this file with
``vfork()`` instead (no uid change, no ``preexec_fn``: nothing of gRPC runs in
that child), by path with ``python -I -S`` and an empty environment, so it
imports only the standard library and nothing the runtime's environment names
runs as root. This process has no thread and no gRPC: it reads the command's
environment from a pipe, drops to the uid and gid with no supplementary
groups, and execs the command.

Arguments: ``ENV_FD READY_FD UID GID EXECUTABLE ARGV0 [ARG …]``. ``ENV_FD``
carries the environment as one JSON object; ``READY_FD`` closes at the exec (so
the substrate reads EOF once the command runs) or carries ``errno:message``
when a step failed, and then this exits 127 without running the command.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    env_fd, ready_fd, uid, gid = map(int, argv[1:5])
    executable, *args = argv[5:]
    try:
        with os.fdopen(env_fd, "rb") as source:
            env = json.loads(source.read())
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if (os.getuid(), os.geteuid(), os.getgid(), os.getegid()) != (uid, uid, gid, gid):
            raise PermissionError(1, f"could not become uid {uid} gid {gid}")
        os.set_inheritable(ready_fd, False)  # closed by the exec: EOF says it ran
        os.execve(executable, args, env)  # noqa: S606 - the runtime's command, as given
    except OSError as error:
        os.write(ready_fd, f"{error.errno or 0}:{error.strerror or error}".encode())
    except ValueError as error:
        os.write(ready_fd, f"0:{error}".encode())
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
