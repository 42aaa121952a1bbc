"""A TCP proxy in front of Redis that can hold Redis's replies back: the "lost
reply" fault, where a command ran but its caller never learned so."""

from __future__ import annotations

import asyncio


class ReplyHoldingProxy:
    """A TCP proxy in front of Redis that can hold Redis's replies back.

    Commands still reach Redis (and run); only their answers wait. That is how a
    Place is caught after its script took a lease but before it learned so.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = False
        self.held = asyncio.Event()
        #: Set whenever a command (any client bytes) is forwarded to Redis.
        self.forwarded = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port: int = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self.holding = True
        self._released.clear()

    def release(self) -> None:
        self.holding = False
        self._released.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        tasks = [
            asyncio.create_task(self._pipe(reader, up_writer, replies=False)),
            asyncio.create_task(self._pipe(up_reader, writer, replies=True)),
        ]
        self._tasks.update(tasks)
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, replies: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if replies and self.holding:
                    self.held.set()
                    await self._released.wait()
                writer.write(data)
                if not replies:
                    self.forwarded.set()
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
