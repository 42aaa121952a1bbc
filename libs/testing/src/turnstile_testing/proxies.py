"""A TCP proxy in front of Redis that can hold Redis's replies back — the "lost
reply" fault, where a command ran but its caller never learned so — or hold one
command back until its caller has given up on it: the "late script" fault."""

from __future__ import annotations

import asyncio

from turnstile_platform.background import BackgroundTasks


class ReplyHoldingProxy:
    """A TCP proxy in front of Redis that can hold Redis's replies back.

    Commands still reach Redis (and run); only their answers wait. That is how a
    Place is caught after its script took a lease but before it learned so.

    :meth:`delay_command` instead holds back one command on its way to Redis
    (every other command, on any connection, passes), until :meth:`deliver`
    sends it on — after its caller gave up, as a retried send or a redirection
    followed after a timeout would. Redis's answer to it is :attr:`late_reply`.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = False
        self.held = asyncio.Event()
        #: Set whenever a command (any client bytes) is forwarded to Redis.
        self.forwarded = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        #: Set when the command :meth:`delay_command` waits for is held back.
        self.delayed = asyncio.Event()
        self._marker: bytes | None = None
        self._deliver = asyncio.Event()
        self._late_reply: asyncio.Future[bytes] | None = None
        self._server: asyncio.Server | None = None
        self._pipes = BackgroundTasks("redis delaying proxy")

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port: int = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self.holding = True
        self._released.clear()

    def release(self) -> None:
        self.holding = False
        self._released.set()

    def delay_command(self, marker: bytes) -> None:
        """Hold back the next command whose bytes contain ``marker``."""
        self._marker = marker
        self.delayed.clear()
        self._deliver.clear()
        self._late_reply = asyncio.get_running_loop().create_future()

    def deliver(self) -> None:
        """Send the delayed command on to Redis."""
        self._deliver.set()

    async def late_reply(self) -> bytes:
        """Redis's answer to the delayed command, once delivered."""
        assert self._late_reply is not None, "no command delayed"
        return await asyncio.shield(self._late_reply)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        delivered: list[asyncio.Future[bytes]] = []  # this connection's late command
        tasks = [
            self._pipes.spawn(
                self._pipe(reader, up_writer, replies=False, late=delivered), name="commands"
            ),
            self._pipes.spawn(
                self._pipe(up_reader, writer, replies=True, late=delivered), name="replies"
            ),
        ]
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        replies: bool,
        late: list[asyncio.Future[bytes]],
    ) -> None:
        try:
            while data := await reader.read(65536):
                if replies and late and not late[0].done():
                    late[0].set_result(data)
                if replies and self.holding:
                    self.held.set()
                    await self._released.wait()
                if not replies and self._marker is not None and self._marker in data:
                    await self._delay(data, writer, late)
                    continue
                writer.write(data)
                if not replies:
                    self.forwarded.set()
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _delay(
        self, data: bytes, writer: asyncio.StreamWriter, late: list[asyncio.Future[bytes]]
    ) -> None:
        """Hold ``data`` until :meth:`deliver`, send it, and wait for Redis's answer
        before reading on (the caller may have closed its side meanwhile: its
        close must not reach Redis before the command does)."""
        assert self._late_reply is not None
        self._marker = None
        late.append(self._late_reply)
        self.delayed.set()
        await self._deliver.wait()
        writer.write(data)
        await writer.drain()
        await asyncio.shield(self._late_reply)

    async def close(self) -> None:
        self.release()
        if self._server is not None:
            self._server.close()
        await self._pipes.close()
