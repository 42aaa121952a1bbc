"""Compensation that must finish even when its caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Cleanups:
    """Runs clean-up coroutines shielded from the caller's cancellation.

    A cancelled ``Activate`` must still delete the pod it may have created. The
    clean-up runs as its own task, held here so the event loop cannot drop it
    (it keeps only weak references to tasks) while the cancelled caller moves on.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, cleanup: Coroutine[Any, Any, None]) -> None:
        """Run ``cleanup`` to completion; a cancelled caller stops waiting, the task goes on."""
        task = asyncio.ensure_future(cleanup)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def wait(self) -> None:
        """Wait for clean-ups still running (on close)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
