"""One Turnstile service as a real process, which a test may SIGKILL and start again.

A process, not an app in the test's own event loop, because what a kill leaves behind
is the point: no drain, no ``finally``, no lease released, sockets reset mid-call.
:meth:`ServiceProcess.kill` is synchronous so a test can call it from a synchronous
hook at the exact moment it cares about (an emulator observer seeing a pod created,
say); :meth:`ServiceProcess.start` starts it again on the same port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from turnstile_platform.health_check import wait_serving
from turnstile_testing.processes import free_port


class ServiceProcess:
    """``python -m <module>`` in plaintext on loopback, with ``env``'s ``TURNSTILE_*``
    settings (the test's own environment's are dropped) and its output in ``log``."""

    def __init__(self, module: str, env: Mapping[str, str], log: Path) -> None:
        self.module = module
        self.port = free_port()
        self.log = log
        self._env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))},
            "OTEL_TRACES_EXPORTER": "none",
            **env,
            "TURNSTILE_HOST": "127.0.0.1",
            "TURNSTILE_PORT": str(self.port),
            "TURNSTILE_PLAINTEXT": "true",
            "TURNSTILE_METRICS_PORT": "0",
            "TURNSTILE_LOG_FORMAT": "text",
        }
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def returncode(self) -> int | None:
        """None while it runs; ``-9`` after :meth:`kill`."""
        return None if self._process is None else self._process.poll()

    async def start(self, timeout_s: float = 90.0) -> ServiceProcess:
        """Start it (again) and wait until its health says SERVING."""
        with self.log.open("ab") as out:
            # Popen, not asyncio's: kill() must be synchronous (see the module doc).
            self._process = await asyncio.to_thread(
                subprocess.Popen,
                [sys.executable, "-m", self.module],
                env=self._env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        if not await wait_serving(self.address, timeout_s=timeout_s):
            raise RuntimeError(f"{self.module} did not come up:\n{self.output()}")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown of any kind. Reaped at once (the signal is final)."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    async def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM, and SIGKILL if it has not exited within ``grace_s``."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.to_thread(process.wait, grace_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def output(self) -> str:
        """The end of its log (empty if it never started)."""
        if not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-5000:]
