"""While ``admit --wait`` or ``activate --wait`` waits in admission's fair queue,
say where it stands (SPEC Q1): the call carries a random ``wait_id``, and
``GetQueuePosition`` is polled every :data:`POLL_S` until it answers. One line
on stderr per change ("waiting: position 2 of 5, about 1.2 s"), so stdout holds
only the final answer and a log of a non-terminal run stays short; nothing in
``--json`` mode."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import grpc.aio

from turnstile_contracts import admission_pb2, common_pb2

if TYPE_CHECKING:
    from turnstile_cli.context import Context

T = TypeVar("T")

#: How often the position is asked for while the call waits.
POLL_S = 0.5
#: A poll that does not answer within this is skipped: the next one comes.
_POLL_TIMEOUT_S = 2.0


def new_wait_id() -> str:
    """A fresh id per call: two calls of one client never share a queue entry."""
    return "cli-" + os.urandom(12).hex()


def describe(found: admission_pb2.GetQueuePositionResponse) -> str | None:
    """The line a person reads, or None when there is nothing to say yet."""
    if found.state == admission_pb2.QUEUE_STATE_GRANTED:
        return "waiting: granted, deciding"
    if found.state != admission_pb2.QUEUE_STATE_WAITING:
        return None
    line = f"waiting: position {found.position} of {found.key_waiters}"
    if found.HasField("estimated_wait"):
        line += f", about {found.estimated_wait.ToMilliseconds() / 1000:.1f} s"
    return line


async def watched(
    ctx: Context,
    client: common_pb2.ActivationClient,
    wait_id: str,
    call: Awaitable[T],
) -> T:
    """Run ``call`` (which carries ``wait_id``) and, while it runs, print where it
    waits. A client given as ``inherit`` is resolved by the substrate: there is
    no client to ask for, so nothing is printed. Polls that fail are skipped (the
    position is a courtesy; the call's own answer is what counts)."""
    task = asyncio.ensure_future(call)
    if ctx.out.json_mode or client.WhichOneof("client") == "inherit":
        return await task
    request = admission_pb2.GetQueuePositionRequest(client=client, wait_id=wait_id)
    last: str | None = None
    async with ctx.admission() as stub:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_S)
            if done:
                break
            try:
                found = await stub.GetQueuePosition(request, timeout=_POLL_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                continue
            line = describe(found)
            if line is not None and line != last and not task.done():
                ctx.out.note(line)
                last = line
    return await task
