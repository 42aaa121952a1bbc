"""A sandbox runtime that looks for secrets, reports what it found, then idles until SIGTERM.

For the Direct substrate's tests of SPEC O4 ("runtimes hold no secrets"): it
plays the untrusted code a runtime runs. It reads ``PRY_TARGETS`` (paths joined
by ``:``) and ``PRY_PORT`` from its environment (the test adds both names to
``TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW``), tries to read each path, and sends one
report to ``127.0.0.1:$PRY_PORT`` in the line format of :func:`report_lines`,
which the test's shell runtime speaks too:

- ``uid <real uid> <effective uid>``
- ``ppid <parent pid>``
- ``env <base64 of the NUL-joined NAME=value pairs of its environment>``
- ``read <path> <base64 of the content>`` or ``denied <path>``
- ``end``

Preloaded (``TURNSTILE_DIRECT_RUNTIME_PRELOAD=turnstile_testing.prying_runtime:main``)
it is forked by the launcher and imports nothing after the fork: a runtime
forked as another uid may not be able to read the interpreter's files.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import sys


def report_lines(environ: dict[str, str], targets: list[str]) -> list[str]:
    """What this process can see: its uids, its environment, each target's content."""
    lines = [f"uid {os.getuid()} {os.geteuid()}", f"ppid {os.getppid()}"]
    pairs = "\0".join(f"{name}={value}" for name, value in environ.items())
    lines.append(f"env {base64.b64encode(pairs.encode()).decode()}")
    for target in targets:
        try:
            with open(target, "rb") as file:
                content = file.read()
        except OSError:
            lines.append(f"denied {target}")
        else:
            lines.append(f"read {target} {base64.b64encode(content).decode()}")
    lines.append("end")
    return lines


def main() -> int:
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    targets = [path for path in os.environ.get("PRY_TARGETS", "").split(":") if path]
    lines = report_lines(dict(os.environ), targets)
    # A plain connect: ``create_connection`` resolves through ``getaddrinfo``,
    # which imports the idna codec (a file the runtime's uid may not read).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as rendezvous:
        rendezvous.connect(("127.0.0.1", int(os.environ["PRY_PORT"])))
        rendezvous.sendall("".join(line + "\n" for line in lines).encode())
    signal.sigwait(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
