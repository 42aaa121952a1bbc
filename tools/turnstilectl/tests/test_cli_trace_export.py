"""An OTLP exporter with no collector behind it costs a command next to nothing:
one refused (or unanswered) attempt, bounded, and one line on stderr, never the
SDK's default 10 s of retries and a screen of warnings."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from turnstile_testing.processes import free_port

#: Runs per setting; the fastest of each is compared (the least disturbed by load).
RUNS = 3


def _targets(address: str) -> list[str]:
    return [f"--{service}={address}" for service in ("admission", "substrate", "affinity")]


def _status(env: dict[str, str], cwd: Path) -> tuple[float, str]:
    """One ``turnstilectl status`` against addresses where nothing answers: the
    command's own time and its stderr."""
    dead = f"127.0.0.1:{free_port()}"
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "turnstile_cli", "status", *_targets(dead)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    elapsed = time.perf_counter() - started
    assert done.returncode == 4, done.stderr  # every service down: exit 4, as without tracing
    return elapsed, done.stderr


@contextmanager
def _silent_listener() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers:
    a collector that hangs rather than refuses."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("collector", ["refusing", "silent"])
def test_an_exporter_with_no_collector_costs_a_command_almost_nothing(
    tmp_path: Path, collector: str
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    base.update({"TURNSTILE_PLAINTEXT": "true", "XDG_STATE_HOME": str(tmp_path / "state")})
    with _silent_listener() as silent:
        port = free_port() if collector == "refusing" else silent
        exporting = {**base, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        plain: list[float] = []
        dead: list[float] = []
        errors = ""
        for _ in range(RUNS):  # interleaved: both see the same machine
            plain.append(_status(base, tmp_path)[0])
            elapsed, errors = _status(exporting, tmp_path)
            dead.append(elapsed)

    # Before the bound: 7 s against 0.3 s (the SDK's retries), a ratio above 20.
    assert min(dead) < 3 * min(plain), (plain, dead)
    exporter_lines = [line for line in errors.splitlines() if "export" in line.lower()]
    assert len(exporter_lines) == 1, errors
    assert "not exported" in exporter_lines[0]
    assert "Transient error" not in errors
    assert "Traceback" not in errors
