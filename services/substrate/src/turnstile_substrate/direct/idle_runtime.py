"""A minimal sandbox runtime: it does nothing until SIGTERM (or SIGINT), then exits 0.

Useful as ``TURNSTILE_DIRECT_RUNTIME_COMMAND="python -m
turnstile_substrate.direct.idle_runtime"`` where the worker agent is not
installed, and in tests: it behaves like a well-mannered runtime (a real
process that exits cleanly when stopped) without attaching anywhere.
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
