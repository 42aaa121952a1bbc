"""A loopback TCP proxy that a test can black-hole: the network between one client and a server.

``blackhole()`` stops forwarding in both directions while keeping every connection open, as a
partitioned network or a hung peer does (no reset, no error: calls just never answer);
``restore()`` forwards again. New connections during a black hole are accepted and left silent.
One proxy per client lets a test cut one replica off while the others keep talking.

With ``pass_closes=False`` a server's close is not passed on: what the server sent before it
is, but the client's connection then stays open and silent (a FIN that never arrives), so a
test can see what a client does with a connection whose last words were an error.

``observe`` makes, for each accepted connection, a sink that is given every chunk the server
sends on it (before it is forwarded): a test can parse the server's protocol messages there,
and so count round trips on the wire rather than trusting a client's own bookkeeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import TracebackType
from typing import Self

#: Makes the sink of one connection's server-to-client bytes.
Observer = Callable[[], Callable[[bytes], None]]


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port``."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        pass_closes: bool = True,
        observe: Observer | None = None,
    ) -> None:
        self._target = (target_host, target_port)
        self._pass_closes = pass_closes
        self._observe = observe
        #: Set when a server closed its side of a connection (its data forwarded).
        self.server_closed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def blackhole(self) -> None:
        """Stop forwarding (connections stay open and silent)."""
        self._open.clear()

    def restore(self) -> None:
        """Forward again."""
        self._open.set()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            self._writers.discard(writer)
            self._tasks.discard(task)
            return
        self._writers.add(up_writer)
        sink = self._observe() if self._observe is not None else None
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer),
                self._pipe(up_reader, writer, from_server=True, sink=sink),
            )
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            for w in (writer, up_writer):
                w.transport.abort()
                self._writers.discard(w)
            self._tasks.discard(task)

    async def _pipe(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        from_server: bool = False,
        sink: Callable[[bytes], None] | None = None,
    ) -> None:
        while True:
            await self._open.wait()
            data = await reader.read(65536)
            if not data:
                if from_server:
                    self.server_closed.set()
                    if not self._pass_closes:
                        await asyncio.get_running_loop().create_future()  # until stop()
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            await self._open.wait()  # data read just before a black hole is held, not sent
            if sink is not None:
                sink(data)
            writer.write(data)
            await writer.drain()
