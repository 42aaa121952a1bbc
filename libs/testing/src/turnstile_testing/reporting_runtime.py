"""A sandbox runtime that reports how it was started, then idles until SIGTERM.

For the Direct substrate's tests of its preloaded launcher
(``TURNSTILE_DIRECT_RUNTIME_PRELOAD=turnstile_testing.reporting_runtime:main``):
it connects to ``127.0.0.1:$RENDEZVOUS_PORT``, sends one JSON line (working
directory, sandbox id, process group and session, parent pid, ``argv[0]``),
prints ``reporting runtime up`` (to the runtime's log), and exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys


def main() -> int:
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    report = {
        "cwd": os.getcwd(),
        "sandbox_id": os.environ.get("TURNSTILE_WORKER_SANDBOX_ID"),
        "group_leader": os.getpgid(0) == os.getpid(),
        "session_leader": os.getsid(0) == os.getpid(),
        "ppid": os.getppid(),
        "argv0": sys.argv[0],
    }
    with socket.create_connection(("127.0.0.1", int(os.environ["RENDEZVOUS_PORT"]))) as rendezvous:
        rendezvous.sendall(json.dumps(report).encode() + b"\n")
    print("reporting runtime up", flush=True)
    signal.sigwait(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
