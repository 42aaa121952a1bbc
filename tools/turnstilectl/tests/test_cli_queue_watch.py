"""``admit --wait`` and ``activate --wait`` against the real admission service (and
substrate) on real Redis (SPEC Q1): while the call waits in a contended fair queue,
the CLI says where it stands, one line per change on stderr; then the final answer,
as without it. Where the position cannot be asked for, one line says why, once."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_cli.cli import run
from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_testing.eventually import eventually
from turnstile_testing.processes import free_port
from turnstile_testing.substrate import direct_substrate_settings, running_substrate

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


@pytest.fixture
async def substrate(
    admission: str, database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> AsyncIterator[str]:
    """The real substrate (Direct runtimes) admitting through the real admission;
    answers its address."""
    settings = direct_substrate_settings(
        database_url, redis_url, redis_prefix, admission, tmp_path / "direct"
    )
    async with running_substrate(settings) as app:
        yield app.address


class NotAdmission:
    """A gRPC server that is not admission (as a mistyped address may reach): it
    serves no method, so every call is UNIMPLEMENTED, and it counts the calls."""

    def __init__(self) -> None:
        self.server = grpc.aio.server()
        self.calls: list[str] = []
        self.address = ""

    async def __aenter__(self) -> NotAdmission:
        calls = self.calls

        class Counting(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in stubs only
            def service(self, details: grpc.HandlerCallDetails) -> None:
                calls.append(details.method)

        self.server.add_generic_rpc_handlers((Counting(),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop(None)


#: Where ``--admission`` points: the service, or a wrong address (and the gRPC code
#: its polls fail with).
ADDRESSES = ["right", "nothing listening", "not admission"]
CODES = {"nothing listening": "UNAVAILABLE", "not admission": "UNIMPLEMENTED"}


@pytest.mark.parametrize("where", ADDRESSES)
async def test_activate_wait_answers_alike_at_any_admission_address_and_says_once_why_no_position(
    admission: str,
    substrate: str,
    capsys: pytest.CaptureFixture[str],
    redis: aioredis.Redis,
    redis_prefix: str,
    where: str,
) -> None:
    """``activate`` reaches admission through the substrate: its call waits and
    succeeds whatever ``--admission`` says; only the position polls go there. At
    a wrong address one line says the position cannot be shown, why and where it
    asked, and the polls go on quietly."""
    async with NotAdmission() as other:
        address = {
            "right": admission,
            "nothing listening": f"127.0.0.1:{free_port()}",
            "not admission": other.address,
        }[where]

        def activate(sandbox_id: str, admission_addr: str, *argv: str) -> int:
            addresses = [f"--admission={admission_addr}", f"--substrate={substrate}"]
            return run(
                [*addresses, "--color", "never", "activate", sandbox_id, "--client", "acme", *argv]
            )

        # The cluster's one token goes; the next activate waits its turn.
        assert await asyncio.to_thread(activate, "sb-0", admission) == 0
        capsys.readouterr()
        waiting = asyncio.ensure_future(
            asyncio.to_thread(activate, "sb-1", address, "--wait", "30s")
        )
        err = ""

        async def told() -> bool:
            nonlocal err
            err += capsys.readouterr().err
            return "waiting: position" in err

        await eventually(told, what="the CLI says where the call waits, or that it cannot")

        async def polled_on() -> bool:
            return len(other.calls) >= 3

        if where == "not admission":  # three polls: the line came once, polling went on
            await eventually(polled_on, what="the polls reach the wrong address")
            assert set(other.calls) == {"/turnstile.admission.v1.AdmissionService/GetQueuePosition"}
        await LimitsStore(redis, redis_prefix).set_cluster(ClusterLimits(rate=50, burst=1))
        assert await waiting == 0
    captured = capsys.readouterr()
    err += captured.err
    said = [line for line in err.splitlines() if "position cannot be shown" in line]
    if where == "right":
        assert said == [], err
        assert err.count("waiting: position 1 of 1") == 1
    else:
        assert len(said) == 1, err
        assert said[0].startswith(
            f"waiting: position cannot be shown (admission at {address}: {CODES[where]}: "
        ), err
        assert said[0].endswith("); still waiting"), err
        assert "waiting: position 1 of 1" not in err
    # The answer, the same at any address.
    first, *lines = captured.out.splitlines()
    rows = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in lines)
    assert first == "✓ sandbox sb-1: created"
    assert rows["charged to"] == "acme"
    assert rows["waited"].endswith("s in admission's fair queue")
    assert rows["queue position"] == "1 when it joined, estimated 1000.000s"


async def test_activate_waiting_on_its_cap_says_the_wait_is_unknown_not_zero(
    start_admission: StartAdmission,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A cap frees when a sandbox stops: with no pace of the key's grants known,
    the estimate is unknown (not "about 0.0 s", what the full bucket alone said)."""
    admission = await start_admission(
        client_allowlist=("acme",), cap={"default_cap": 1}, queue={"tick_interval_s": 0.01}
    )
    settings = direct_substrate_settings(
        database_url, redis_url, redis_prefix, admission, tmp_path / "direct"
    )
    async with running_substrate(settings) as app:

        def call(*argv: str) -> int:
            addresses = [f"--admission={admission}", f"--substrate={app.address}"]
            return run([*addresses, "--color", "never", *argv])

        assert await asyncio.to_thread(call, "activate", "sb-0", "--client", "acme") == 0
        capsys.readouterr()
        # Refused at once, it says what frees the cap rather than a time to retry.
        assert await asyncio.to_thread(call, "activate", "sb-2", "--client", "acme") == 3
        refused = " ".join(capsys.readouterr().err.split())
        assert "frees when one of its 1 live or pending sandboxes stops" in refused, refused
        assert "→ frees when one of the key's sandboxes stops; check again in 5 s" in refused
        assert "retry in" not in refused
        waiting = asyncio.ensure_future(
            asyncio.to_thread(
                call, "activate", "sb-1", "--client", "acme", "--wait", "30s", "--queue-per-client"
            )
        )
        err = ""

        async def told() -> bool:
            nonlocal err
            err += capsys.readouterr().err
            return "waiting: position" in err

        await eventually(told, what="the CLI says where the call waits")
        assert "waiting: position 1 of 1, wait unknown" in err, err
        assert "about" not in err
        assert await asyncio.to_thread(call, "deactivate", "sb-0") == 0  # the cap frees
        assert await waiting == 0
    captured = capsys.readouterr()
    assert "✓ sandbox sb-1: created" in captured.out
    assert "estimated wait unknown" in captured.out
