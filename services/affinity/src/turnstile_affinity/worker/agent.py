"""The worker agent's connection to the relay: hello, heartbeats, goodbye, reconnects.

One stream at a time. A Hello unanswered for ``welcome_timeout_s`` is given up
and retried like a failed stream. The Welcome says how often to heartbeat and how long
presence lasts; a stream whose acks stop for that long is treated as dead (the
relay or the network went away without closing it) and replaced. Any stream
end other than our own Goodbye leads to a reconnect with exponential backoff
and full jitter (:mod:`.backoff`), reset once a new stream is welcomed. A Hello
the relay refuses as invalid is not retried: the configuration must change.

The channel keeps the connection alive with HTTP/2 pings and, given a DNS name
with several addresses (a headless Service), picks one of them at random
(``pick_first`` with a shuffled address list): workers spread over relay
replicas, and when a replica ends a stream at its maximum age (after sending the
connection GOAWAY) the next stream goes over a new connection, to any replica.

A worker in a warm-pool pod does not know its sandbox yet: it waits, without
connecting, until the pod's labels file names one (:mod:`.podlabels`).

The Hello carries the sandbox credential (:mod:`.credential`), read afresh for
each stream; a credential renewed meanwhile is presented on the live stream. A
refused credential (PERMISSION_DENIED) is retried with backoff, reading the file
again: the substrate may renew it meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from collections.abc import Iterator

import grpc
import grpc.aio

from turnstile_affinity.worker.backoff import reconnect_delays
from turnstile_affinity.worker.credential import read_credential, wait_for_credential
from turnstile_affinity.worker.podlabels import wait_for_sandbox_id
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform import tls

log = logging.getLogger(__name__)


def _relay_channel(settings: WorkerSettings) -> grpc.aio.Channel:
    """The channel to the relay: mTLS with the worker's sandbox-class certificate
    (read once: a runtime lives shorter than its certificate) to a server that must
    hold ``affinity_spiffe_id`` (SPEC O5: another runtime listening on a port the
    worker dials cannot pose as the relay), or loopback plaintext."""
    options = channel_options(settings.keepalive_time_s)
    source = tls.client_source(
        settings, settings.affinity_addr, "worker agent", server_id=settings.affinity_spiffe_id
    )
    if source is None:
        return grpc.aio.insecure_channel(settings.affinity_addr, options=options)
    return grpc.aio.secure_channel(
        settings.affinity_addr, source.credentials, options=[*options, *source.options]
    )


Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]
#: What ``read()`` returns at the end of a stream (not in grpc-stubs).
_EOF: object = grpc.aio.EOF  # type: ignore[attr-defined]


#: Spread workers over the addresses a name resolves to, one connection each.
_SERVICE_CONFIG = json.dumps(
    {"loadBalancingConfig": [{"pick_first": {"shuffleAddressList": True}}]}
)


def channel_options(keepalive_time_s: float) -> list[tuple[str, object]]:
    """The relay channel's arguments: keepalive pings and random replica choice.

    Pings go out every ``keepalive_time_s`` even without a call in flight; the
    relay tolerates pings every 10 s or more (``TURNSTILE_KEEPALIVE_MIN_PING_INTERVAL_S``).
    """
    return [
        ("grpc.keepalive_time_ms", round(keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.service_config", _SERVICE_CONFIG),
        # A connection of its own: channels sharing gRPC's global subchannel pool
        # (several agents in one process) would all pick the one already connected.
        ("grpc.use_local_subchannel_pool", 1),
    ]


class HelloRefusedError(Exception):
    """The relay refused the Hello as invalid; reconnecting would not help."""


class StreamEndedError(Exception):
    """The relay ended the stream, or stopped answering."""


class WorkerAgent:
    """Keeps one worker's presence at the relay until :attr:`stop` is set."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.stop = asyncio.Event()
        #: Set while a stream is welcomed (tests and logs use it).
        self.attached = asyncio.Event()
        #: Set once a welcomed stream has ended, until the next Welcome: lets a caller
        #: wait for the worker to notice a lost relay before expecting it to re-attach.
        self.detached = asyncio.Event()
        #: Set once the worker waits for its sandbox id (a warm pod not yet adopted).
        self.waiting_for_sandbox = asyncio.Event()
        #: The sandbox this worker serves: from settings, or once read from the labels file.
        self.sandbox_id: str | None = settings.sandbox_id
        #: The credential presented on the current stream ("" for none).
        self.presented_credential = ""
        #: Set each time the relay accepts a renewed credential (tests and logs use it).
        self.renewal_accepted = asyncio.Event()
        #: How many streams the relay has welcomed (tests and logs use it).
        self.welcomes = 0
        self._welcomed = asyncio.Condition()
        self._rng = random.Random()

    async def run(self) -> None:
        """Learn the sandbox id if need be, then attach, and re-attach after failures,
        until :attr:`stop`; then Goodbye. Raises
        :class:`~turnstile_affinity.worker.podlabels.SandboxIdError` when the labels
        file names an invalid sandbox id."""
        settings = self.settings
        if self.sandbox_id is None:
            assert settings.sandbox_id_file is not None  # the settings require one of the two
            self.sandbox_id = await wait_for_sandbox_id(
                settings.sandbox_id_file,
                settings.sandbox_id_poll_s,
                self.stop,
                self.waiting_for_sandbox,
            )
            if self.sandbox_id is None:  # stopped before adoption: never attached
                return
        if settings.credential_file is not None:
            credential = await wait_for_credential(
                settings.credential_file, settings.sandbox_id_poll_s, self.stop
            )
            if credential is None:  # stopped before the substrate wrote it
                return
        sandbox_id = self.sandbox_id
        delays = self._delays()
        async with _relay_channel(settings) as channel:
            stub: affinity_pb2_grpc.AffinityServiceAsyncStub = (
                affinity_pb2_grpc.AffinityServiceStub(channel)
            )
            while not self.stop.is_set():
                try:
                    await self._stream(stub, sandbox_id)
                except grpc.aio.AioRpcError as error:
                    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise HelloRefusedError(error.details() or "") from error
                    if error.code() == grpc.StatusCode.PERMISSION_DENIED:
                        log.warning(
                            "the relay refused this worker's credential; retrying",
                            extra={"detail": error.details()},
                        )
                    log.warning(
                        "relay stream failed; reconnecting",
                        extra={"code": error.code().name, "detail": error.details()},
                    )
                except StreamEndedError as ended:
                    log.warning("relay stream ended; reconnecting", extra={"why": str(ended)})
                finally:
                    welcomed = self.attached.is_set()
                    self.attached.clear()
                    if welcomed:
                        self.detached.set()
                if self.stop.is_set():
                    break
                if welcomed:  # a stream that had been welcomed: start backing off afresh
                    delays = self._delays()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), timeout=next(delays))

    async def welcomed(self, count: int) -> None:
        """Return once the relay has welcomed ``count`` streams of this worker."""
        async with self._welcomed:
            await self._welcomed.wait_for(lambda: self.welcomes >= count)

    def _delays(self) -> Iterator[float]:
        settings = self.settings
        return reconnect_delays(settings.reconnect_initial_s, settings.reconnect_max_s, self._rng)

    async def _stream(
        self, stub: affinity_pb2_grpc.AffinityServiceAsyncStub, sandbox_id: str
    ) -> None:
        """One stream's life. Returns after a clean Goodbye; raises otherwise."""
        settings = self.settings
        call: Call = stub.Attach(None)  # None: messages are written with call.write
        try:
            self.presented_credential = self._credential() or ""
            hello = affinity_pb2.Hello(
                sandbox_id=sandbox_id,
                labels=settings.labels,
                capacity=settings.capacity,
                credential=self.presented_credential,
            )
            first = await self._hello(call, hello)
            if first is None:  # stopped while waiting for the Welcome
                return
            if not isinstance(first, affinity_pb2.AttachResponse) or not first.HasField("welcome"):
                await _raise_status(call)
                raise StreamEndedError("no Welcome")
            welcome = first.welcome
            interval = max(welcome.heartbeat_interval.ToTimedelta().total_seconds(), 0.05)
            silence = max(welcome.presence_ttl.ToTimedelta().total_seconds(), interval * 2)
            self.detached.clear()
            async with self._welcomed:
                self.welcomes += 1
                self._welcomed.notify_all()
            self.attached.set()
            log.info(
                "attached to the relay",
                extra={"sandbox_id": sandbox_id, "labels": settings.labels},
            )
            await self._heartbeats(call, interval, silence)
        finally:
            if not call.done():
                call.cancel()

    async def _hello(self, call: Call, hello: affinity_pb2.Hello) -> object | None:
        """Send the Hello and return the relay's first answer; None once stopped.

        Bounded by ``welcome_timeout_s``: a stream opened just as its connection
        went away may never be answered, and nothing else would notice until the
        keepalive timeout, if at all.
        """
        timeout = self.settings.welcome_timeout_s

        async def exchange() -> object:
            await call.write(affinity_pb2.AttachRequest(hello=hello))
            return await call.read()

        answer = asyncio.ensure_future(exchange())
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait(
                {answer, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (answer, stopping):
                task.cancel()
            await asyncio.gather(answer, stopping, return_exceptions=True)
        if answer in done:
            return answer.result()
        if stopping in done:
            return None
        raise StreamEndedError(f"no Welcome within {timeout:g}s")

    async def _heartbeats(self, call: Call, interval: float, silence: float) -> None:
        """Heartbeat every ``interval`` until stop (then Goodbye) or the stream dies."""
        loop = asyncio.get_running_loop()
        last_ack = loop.time()
        reader = asyncio.ensure_future(call.read())
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            next_beat = loop.time() + interval
            while True:
                timeout = max(0.0, next_beat - loop.time())
                done, _ = await asyncio.wait(
                    {reader, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if stopping in done:
                    await self._goodbye(call, reader)
                    return
                if reader in done:
                    message = reader.result()
                    if message is _EOF:
                        await _raise_status(call)
                        raise StreamEndedError("the relay closed the stream")
                    last_ack = loop.time()
                    if isinstance(message, affinity_pb2.AttachResponse) and message.HasField(
                        "credential_accepted"
                    ):
                        self.renewal_accepted.set()
                    reader = asyncio.ensure_future(call.read())
                    continue
                if loop.time() - last_ack > silence:
                    raise StreamEndedError(f"no answer from the relay for {silence:.1f}s")
                await self._present_renewed(call)
                await call.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
                next_beat = loop.time() + interval
        finally:
            for task in (reader, stopping):
                task.cancel()
            await asyncio.gather(reader, stopping, return_exceptions=True)

    def _credential(self) -> str | None:
        path = self.settings.credential_file
        return read_credential(path) if path is not None else None

    async def _present_renewed(self, call: Call) -> None:
        """Present the credential file's content if the substrate renewed it."""
        credential = self._credential()
        if credential is None or credential == self.presented_credential:
            return
        renewal = affinity_pb2.CredentialRenewal(credential=credential)
        await call.write(affinity_pb2.AttachRequest(renewal=renewal))
        self.presented_credential = credential
        log.info("presented a renewed sandbox credential", extra={"sandbox_id": self.sandbox_id})

    async def _goodbye(self, call: Call, reader: asyncio.Future[object]) -> None:
        """Say Goodbye and wait, briefly, until the relay has removed presence.

        The relay ends the stream only after its teardown (presence removed, detach
        mark written), so the stream's status means the teardown is done.
        """
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await call.write(affinity_pb2.AttachRequest(goodbye=affinity_pb2.Goodbye()))
            await call.done_writing()
        try:
            async with asyncio.timeout(self.settings.goodbye_timeout_s):
                message = await reader
                while message is not _EOF:
                    message = await call.read()
                await call.code()
        except (TimeoutError, grpc.aio.AioRpcError):
            log.warning("the relay did not confirm the Goodbye")
            return
        log.info("said goodbye to the relay", extra={"sandbox_id": self.sandbox_id})


async def _raise_status(call: Call) -> None:
    """Raise the stream's error status, if it ended with one."""
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise grpc.aio.AioRpcError(
            code,
            await call.initial_metadata(),
            await call.trailing_metadata(),
            await call.details(),
            None,
        )
