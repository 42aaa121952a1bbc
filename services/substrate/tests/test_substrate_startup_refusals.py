"""The substrate's entry point refuses settings it cannot start with as every
start-up refusal does: one log line saying what to set, exit status 2, no traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turnstile_platform.runner import EXIT_MISCONFIGURED


async def start_substrate(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "turnstile_substrate"],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_refused_in_one_line(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == EXIT_MISCONFIGURED, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    refusals = [line for line in result.stderr.splitlines() if "refusing to start" in line]
    assert len(refusals) == 1, result.stderr[-3000:]
    for word in words:
        assert word in refusals[0], refusals[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the refusal is a root substrate's")
@pytest.mark.timeout(90)
async def test_a_root_substrate_with_no_runtime_user_refuses_in_one_line(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    result = await start_substrate(
        {
            "TURNSTILE_PLAINTEXT": "true",
            "TURNSTILE_LOG_FORMAT": "text",
            "TURNSTILE_PORT": "0",
            "TURNSTILE_SUBSTRATE_KIND": "direct",
            "TURNSTILE_DIRECT_STATE_DIR": str(tmp_path / "direct"),
            "TURNSTILE_REDIS_URL": redis_url,
            "TURNSTILE_REDIS_PREFIX": redis_prefix,
            "TURNSTILE_DATABASE_URL": database_url,
        }
    )
    assert_refused_in_one_line(
        result, "runs as root", "TURNSTILE_DIRECT_RUNTIME_UIDS", "TURNSTILE_DIRECT_RUNTIME_USER"
    )


@pytest.mark.timeout(90)
async def test_contradicting_runtime_user_settings_refuse_in_one_line(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    result = await start_substrate(
        {
            "TURNSTILE_PLAINTEXT": "true",
            "TURNSTILE_LOG_FORMAT": "text",
            "TURNSTILE_PORT": "0",
            "TURNSTILE_DIRECT_STATE_DIR": str(tmp_path / "direct"),
            "TURNSTILE_DIRECT_RUNTIME_USER": "nobody",
            "TURNSTILE_DIRECT_RUNTIME_UIDS": "2702000-2702009",
            "TURNSTILE_REDIS_URL": redis_url,
            "TURNSTILE_REDIS_PREFIX": redis_prefix,
            "TURNSTILE_DATABASE_URL": database_url,
        }
    )
    assert_refused_in_one_line(result, "set one of TURNSTILE_DIRECT_RUNTIME_USER")
