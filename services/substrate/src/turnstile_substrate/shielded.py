"""Work that must not stop half-way when its caller is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


async def run_to_end(work: Awaitable[None]) -> None:
    """Run ``work`` to the end even if the caller is cancelled meanwhile (the
    compensation or commit of an activation, the release of its claim), then
    let the cancellation through."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise
