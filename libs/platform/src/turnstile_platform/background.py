"""Background tasks a component starts and owns: one pattern, written once.

asyncio keeps only weak references to tasks, so a task nobody holds can vanish
mid-flight; one whose exception nobody reads is reported, if at all, as "Task
exception was never retrieved" when it is collected; one nobody cancels on
shutdown outlives its component. :class:`BackgroundTasks` holds each task it
starts until it ends, names it, logs its failure once (with the traceback), and
cancels and awaits what is left on :meth:`~BackgroundTasks.close`.

Where a task runs (every replica, or only the leader) is its owner's decision:
leader work runs under :class:`turnstile_platform.leader.LeaderElector`, which
starts and stops it with each term.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class _Restarts:
    backoff_s: float
    max_backoff_s: float
    forever: bool
    on_restart: Callable[[], object] | None


class BackgroundTasks:
    """The tasks one component started and has not seen end."""

    def __init__(self, owner: str) -> None:
        #: Who started the tasks (the log lines' ``owner``).
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(
        self,
        work: Coroutine[Any, Any, T],
        *,
        name: str,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        """Start ``work`` as a task held here until it ends; returns at once."""
        task = asyncio.get_running_loop().create_task(work, name=name, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def adopt(self, task: asyncio.Task[Any]) -> None:
        """Hold a task started elsewhere until it ends, quietly: its failure is
        retrieved, not logged (a call its caller stopped waiting for, whose error
        is nobody's to see)."""
        self._tasks.add(task)
        task.add_done_callback(self._dropped)

    async def stop(self, task: asyncio.Task[Any]) -> None:
        """Cancel one task and wait until it has ended (a cancellation of the
        caller's own still propagates)."""
        task.cancel()
        await asyncio.wait([task])

    def supervise(
        self,
        work: Callable[[], Awaitable[None]],
        *,
        name: str,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        forever: bool = False,
        on_restart: Callable[[], object] | None = None,
    ) -> asyncio.Task[None]:
        """Run ``work()`` again whenever it fails, waiting ``backoff_s`` (doubled
        after each failure in a row, at most ``max_backoff_s``; reset once a run
        lasted longer than the wait before it). It ends when ``work()`` returns
        (with ``forever``, that is restarted too), or when the task is cancelled
        (:meth:`close`). ``on_restart`` is called before each restart (a metric)."""
        restarts = _Restarts(backoff_s, max_backoff_s, forever, on_restart)
        return self.spawn(self._supervised(work, name, restarts), name=name)

    async def shielded(self, work: Coroutine[Any, Any, T]) -> T:
        """Run ``work`` to its end even if the caller is cancelled meanwhile (a
        cancelled ``Activate`` must still delete the pod it may have created):
        the caller stops waiting, the task goes on, held here."""
        return await asyncio.shield(self.spawn(work, name=f"{self.owner}: shielded"))

    async def wait(self) -> None:
        """Wait for every task still running to end by itself."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every task still running and wait until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error(
                "background task failed",
                exc_info=error,
                extra={"owner": self.owner, "task": task.get_name()},
            )

    async def _supervised(
        self, work: Callable[[], Awaitable[None]], name: str, restarts: _Restarts
    ) -> None:
        loop = asyncio.get_running_loop()
        pause = restarts.backoff_s
        while True:
            started = loop.time()
            extra = {"owner": self.owner, "task": name, "retry_in_s": pause}
            try:
                await work()
                if not restarts.forever:
                    return
                log.warning("background task returned; restarting", extra=extra)
            except Exception:
                log.exception("background task failed; restarting", extra=extra)
            if restarts.on_restart is not None:
                restarts.on_restart()
            if loop.time() - started > pause:
                pause = restarts.backoff_s
            await asyncio.sleep(pause)
            pause = min(pause * 2, restarts.max_backoff_s)

    def _dropped(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: see adopt()


async def run_to_end(work: Awaitable[T]) -> T:
    """Run ``work`` to its end even if the caller is cancelled meanwhile, then let
    the cancellation through: the caller waits for it (unlike
    :meth:`BackgroundTasks.shielded`), so nothing needs to hold the task after."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise
