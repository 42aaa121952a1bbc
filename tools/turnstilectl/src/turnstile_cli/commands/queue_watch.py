"""While ``admit --wait`` or ``activate --wait`` waits in admission's fair queue,
say where it stands (SPEC Q1): the call carries a random ``wait_id``, and
``GetQueuePosition`` is polled every :data:`POLL_S` until it answers. One line
on stderr per change ("waiting: position 2 of 5, about 1.2 s", or "wait unknown"
when admission knows no pace), so stdout holds
only the final answer and a log of a non-terminal run stays short; a poll that
fails is said once, with why and where; nothing in ``--json`` mode."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

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
    else:
        # Unset: no pace is known (a cap or lease frees when a sandbox stops).
        line += ", wait unknown"
    return line


def unshown(address: str, why: str) -> str:
    """The one line said when the position cannot be asked for: why, and the
    admission address asked."""
    return f"waiting: position cannot be shown (admission at {address}: {why}); still waiting"


def rpc_failure(error: grpc.aio.AioRpcError) -> str:
    """A failed call's code and details, on one line."""
    details = " ".join((error.details() or "").split())
    return f"{error.code().name}: {details}" if details else error.code().name


async def watched(
    ctx: Context,
    client: common_pb2.ActivationClient,
    wait_id: str,
    call: Awaitable[T],
) -> T:
    """Run ``call`` (which carries ``wait_id``) and, while it runs, print where it
    waits. A client given as ``inherit`` is resolved by the substrate: there is
    no client to ask for, so nothing is printed.

    The position is a courtesy; the call's own answer is what counts. The polls
    run beside the call and are cancelled the moment it answers, so a slow or
    failing admission never delays nor fails it."""
    task = asyncio.ensure_future(call)
    if ctx.out.json_mode or client.WhichOneof("client") == "inherit":
        return await task
    request = admission_pb2.GetQueuePositionRequest(client=client, wait_id=wait_id)
    poller = asyncio.ensure_future(_poll(ctx, request, task))
    try:
        return await task
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)


async def _poll(
    ctx: Context, request: admission_pb2.GetQueuePositionRequest, call: asyncio.Future[Any]
) -> None:
    """Ask for the position every :data:`POLL_S` until cancelled; one line per change.

    The first poll that fails is said, once, on one line (:func:`unshown`: the gRPC
    code and details, and the address asked): ``activate`` reaches admission only
    through the substrate, so with a wrong ``--admission`` address its own call
    succeeds while every poll fails, and a person would see no position and no
    reason. Polling then goes on quietly rather than stopping: a failure may pass (a
    poll's deadline under load, an admission replica restarting), and positions
    are shown again once a poll answers. One poll is in flight at a time, and a
    channel that cannot connect fails the next ones at once, in reconnect backoff."""
    address = ctx.targets.admission
    last: str | None = None
    said = False

    def say_once(why: str) -> None:
        nonlocal said
        if not said and not call.done():
            ctx.out.note(unshown(address, why))
            said = True

    async with contextlib.AsyncExitStack() as opened:
        try:
            stub = await opened.enter_async_context(ctx.admission())
        except Exception as error:  # no channel (its TLS files): the call goes on without
            say_once(str(error))
            return
        while True:
            await asyncio.sleep(POLL_S)
            try:
                found = await stub.GetQueuePosition(request, timeout=_POLL_TIMEOUT_S)
            except grpc.aio.AioRpcError as error:
                say_once(rpc_failure(error))
                continue
            line = describe(found)
            if line is not None and line != last and not call.done():
                ctx.out.note(line)
                last = line
