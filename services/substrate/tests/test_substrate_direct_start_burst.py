"""Runtimes started right after start-up, many at once, in a serving gRPC process.

The fault this guards: with runtimes run as another uid and started from their
command, ``subprocess.Popen(user=…)`` forked the substrate's threaded gRPC process,
and gRPC's fork handlers aborted in the child before its exec (the first
activations came back ``RUNTIME_FAILED``, "runtime exited at once with status
-6"). The driver (``direct_start_burst_process.py``) runs a grpc.aio server with
calls in flight and registers a fork handler that aborts in every fork child, so
any start that forks that process fails every time; each mode must start every
runtime. The modes with another uid need a root test run (the suite's, here).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from turnstile_substrate.direct import processes
from turnstile_substrate.direct.runtime_users import parse_range

DRIVER = Path(__file__).with_name("direct_start_burst_process.py")
#: Other tests use other ranges, so parallel runs never share a uid.
UIDS = "2701000-2701099"
SHARED_UID = "2701200"
#: A runtime any uid can run (the venv's interpreter is not readable by others here).
SLEEPER = "/bin/sleep infinity"
PRELOAD = "turnstile_substrate.direct.idle_runtime:main"
BURST = 12

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="another uid needs a root substrate")

MODES = {
    "command, its own uid": ({}, False),
    "command, one shared uid": ({"TURNSTILE_DIRECT_RUNTIME_USER": SHARED_UID}, True),
    "command, a uid per runtime": ({"TURNSTILE_DIRECT_RUNTIME_UIDS": UIDS}, True),
    "launcher, its own uid": ({"TURNSTILE_DIRECT_RUNTIME_PRELOAD": PRELOAD}, False),
    "launcher, a uid per runtime": (
        {"TURNSTILE_DIRECT_RUNTIME_PRELOAD": PRELOAD, "TURNSTILE_DIRECT_RUNTIME_UIDS": UIDS},
        True,
    ),
}


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state directory under a parent any uid may traverse, as the stack lays it out."""
    root = Path(tempfile.mkdtemp(prefix="turnstile-burst-", dir="/tmp"))
    os.chmod(root, 0o711)  # noqa: S103 - traversable, as a state directory's parents must be
    try:
        yield root / "direct"
    finally:
        for uid in processes.live_uids({*parse_range(UIDS), int(SHARED_UID)}):
            processes.kill_user(uid)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.timeout(120)
async def test_a_burst_of_runtimes_right_after_start_up_all_start(
    mode: str, state_dir: Path
) -> None:
    settings, other_uid = MODES[mode]
    if other_uid and os.geteuid() != 0:
        pytest.skip("another uid needs a root substrate")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "TURNSTILE_DIRECT_STATE_DIR": str(state_dir),
        "TURNSTILE_DIRECT_RUNTIME_COMMAND": SLEEPER,
        "TURNSTILE_AFFINITY_ADDR": "127.0.0.1:50999",
        "TURNSTILE_PLAINTEXT": "true",  # no worker certificate: not what this is about
        **settings,
    }
    if os.geteuid() == 0 and not other_uid:
        env["TURNSTILE_DIRECT_RUNTIME_USER"] = "root"  # its own uid, said explicitly
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(DRIVER), str(BURST), "--abort-in-fork-child"],
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["failed"] == {}, report["failed"]
    assert len(report["started"]) == BURST
