"""The Direct substrate's preloaded launcher: runtimes forked from a process that
imported them already, started exactly as the command would start them."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from turnstile_substrate.direct import processes
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings

IDLE = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"
REPORTING = "turnstile_testing.reporting_runtime:main"


async def no_gate() -> None:
    return None


class Reports:
    """A socket runtimes report to: the test awaits a report instead of sleeping."""

    def __init__(self) -> None:
        self.lines: asyncio.Queue[dict[str, object]] = asyncio.Queue()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Reports:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self.lines.put(json.loads(await reader.readline()))
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def next(self) -> dict[str, object]:
        async with asyncio.timeout(60):
            return await self.lines.get()


@pytest.fixture
async def reports(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Reports]:
    async with Reports() as reports:
        monkeypatch.setenv("RENDEZVOUS_PORT", str(reports.port))
        yield reports


def direct(state_dir: Path, preload: str) -> DirectSubstrate:
    return DirectSubstrate(
        SubstrateSettings(
            direct_state_dir=state_dir,
            direct_runtime_command=IDLE,
            direct_runtime_preload=preload,
            direct_runtime_user=str(os.getuid()),
            # The reporting runtime's one setting (runtimes get an allowlist, SPEC O4).
            direct_runtime_env_allow="RENDEZVOUS_PORT",
            affinity_addr="127.0.0.1:50999",
        )
    )


def spec(sandbox_id: str) -> RuntimeSpec:
    return RuntimeSpec(sandbox_id=sandbox_id, tier="", client_label="acme")


async def test_a_preloaded_runtime_is_forked_into_its_own_session_workspace_and_log(
    state_dir: Path, reports: Reports
) -> None:
    substrate = direct(state_dir, REPORTING)
    await substrate.start()
    try:
        for sandbox_id in ("sb-1", "sb-2"):
            wanted = spec(sandbox_id)
            await substrate.ensure_runtime(wanted, substrate.plan(wanted), no_gate)
            report = await reports.next()
            assert report["cwd"] == str(state_dir / sandbox_id / "workspace")
            assert report["sandbox_id"] == sandbox_id
            assert report["group_leader"]
            assert report["session_leader"]
            assert report["argv0"] == sys.executable
            # Forked by the launcher, not started by this process.
            assert report["ppid"] != os.getpid()
        record = json.loads((state_dir / "sb-1" / "runtime.json").read_text())
        assert processes.is_alive(record["pid"], record["start_ticks"])
        assert await substrate.stop_runtime("sb-1")
        assert not processes.is_alive(record["pid"], record["start_ticks"])
        assert "reporting runtime up" in (state_dir / "sb-1" / "runtime.log").read_text()
        assert await substrate.find_running("sb-2") is not None
        assert await substrate.stop_runtime("sb-2")
    finally:
        await substrate.close()


async def test_a_launcher_that_cannot_preload_falls_back_to_the_command(state_dir: Path) -> None:
    substrate = direct(state_dir, "turnstile_no_such_module:main")
    await substrate.start()
    try:
        wanted = spec("sb-1")
        runtime = await substrate.ensure_runtime(wanted, substrate.plan(wanted), no_gate)
        assert await substrate.find_running("sb-1") == runtime
        assert await substrate.stop_runtime("sb-1")
    finally:
        await substrate.close()
