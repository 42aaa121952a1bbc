"""Every CLI test reads and writes the per-user stack description under its own
directory: a developer's running stack (``~/.local/state/turnstile``) is never
taken for the test's, nor the test's for theirs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys.live_counts import COUNTED, LiveCountKeys
from turnstile_testing.admission import admission_settings, running_admission

#: Starts the real admission service on real Redis with settings over the test's
#: defaults; answers its address.
StartAdmission = Callable[..., Awaitable[str]]


@pytest.fixture(autouse=True)
def _own_state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))


@pytest.fixture
async def start_admission(
    redis_url: str, redis_prefix: str, redis: aioredis.Redis
) -> AsyncIterator[StartAdmission]:
    """The real admission service for the CLI to talk to (its live counts marked
    counted: nothing is unknown), stopped after the test."""
    await redis.set(LiveCountKeys(redis_prefix).state, COUNTED)
    async with AsyncExitStack() as apps:

        async def start(**overrides: Any) -> str:
            settings = admission_settings(redis_url, redis_prefix, **overrides)
            app = await apps.enter_async_context(running_admission(settings))
            return app.address

        yield start
