"""Waiting for a condition a test cannot await as an event.

Most waits in the tests await an event (a server's answer, a task, a queue).
Some state changes only show in another process's store — a key in Redis, a
row in PostgreSQL, a file — with nothing to subscribe to; :func:`eventually`
polls those, at a short interval, up to a deadline that fails the test with
what it was waiting for.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")


@overload
async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str = ...,
) -> T: ...


@overload
async def eventually(
    probe: Callable[[], T],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str = ...,
) -> T: ...


async def eventually(
    probe: Callable[[], Any],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str = "",
) -> Any:
    """The first truthy result of ``probe()`` (a function or a coroutine
    function); AssertionError naming ``what`` (or the probe) after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = probe()
        value = await result if inspect.isawaitable(result) else result
        if value:
            return value
        if loop.time() >= deadline:
            name = what or getattr(probe, "__qualname__", repr(probe))
            raise AssertionError(f"not true within {timeout_s:g}s: {name} (last: {value!r})")
        await asyncio.sleep(interval_s)
