"""``admit --wait`` against the real admission service on real Redis (SPEC Q1):
while the call waits in a contended fair queue, the CLI says where it stands,
one line per change on stderr; then the final answer, as without it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from turnstile_cli.cli import run
from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_testing.eventually import eventually

if TYPE_CHECKING:
    from conftest import StartAdmission


@pytest.fixture
async def admission(start_admission: StartAdmission) -> str:
    # One token per 1000 s: a second call waits.
    return await start_admission(
        client_allowlist=("acme",),
        rate={"cluster_rate_per_s": 0.001, "cluster_burst": 1},
        queue={"tick_interval_s": 0.01},
    )


def cli(address: str, *argv: str) -> int:
    return run([f"--admission={address}", "--color", "never", *argv])


async def test_admit_wait_prints_its_position_live_then_the_answer(
    admission: str, capsys: pytest.CaptureFixture[str], redis: aioredis.Redis, redis_prefix: str
) -> None:
    assert await asyncio.to_thread(cli, admission, "admit", "sb-0", "--client", "acme") == 0
    waiting = asyncio.ensure_future(
        asyncio.to_thread(cli, admission, "admit", "sb-1", "--client", "acme", "--wait", "30s")
    )
    err = ""

    async def told() -> bool:
        nonlocal err
        err += capsys.readouterr().err
        return "waiting: position 1 of 1, about" in err

    await eventually(told, what="the CLI says where the call waits")
    # One token per 1000 s: it waits; then the bucket refills fast and it is admitted.
    await LimitsStore(redis, redis_prefix).set_cluster(ClusterLimits(rate=50, burst=1))
    assert await waiting == 0
    captured = capsys.readouterr()
    err += captured.err
    assert err.count("waiting: position 1 of 1") == 1  # one line per change
    assert "admitted" in captured.out.lower()
    assert "in the fair queue" in captured.out
