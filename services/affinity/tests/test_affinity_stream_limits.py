"""Untrusted Attach streams are bounded (SPEC O6): real relay over real gRPC sockets,
real Redis, real credentials (and real certificates where identities matter).

A stream holds a slot only once its Hello is accepted; until then it waits under a
deadline, and past the waiting limit the longest-waiting stream is pushed out, so
silent streams cannot keep a real worker out. Heartbeats and renewals past a
stream's budget are dropped unanswered (no Redis script, no signature check).
Refusal log lines are throttled per identity and reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
from grpc.aio import EOF  # type: ignore[attr-defined]  # exported, not in the stubs
from prometheus_client import REGISTRY

from turnstile_affinity import attestation, stream_limits
from turnstile_contracts import affinity_pb2
from turnstile_platform.authz import authorizer
from turnstile_platform.errors import RichError, decode
from turnstile_platform.log_throttle import LogThrottle
from turnstile_platform.tiers import TIER_LABEL
from turnstile_testing.pki import Pki

if TYPE_CHECKING:
    from conftest import Affinity, Credentials, StartAffinity, StartWorker

Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]
SERVICE = affinity_pb2.DESCRIPTOR.services_by_name["AffinityService"].full_name
ATTACH = f"/{SERVICE}/Attach"
HEARTBEAT = affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat())
GOODBYE = affinity_pb2.AttachRequest(goodbye=affinity_pb2.Goodbye())


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _hello(sandbox_id: str, credential: str) -> affinity_pb2.AttachRequest:
    return affinity_pb2.AttachRequest(
        hello=affinity_pb2.Hello(
            sandbox_id=sandbox_id, capacity=2, labels={TIER_LABEL: "a"}, credential=credential
        )
    )


async def _welcomed(service: Affinity, credentials: Credentials, sandbox_id: str) -> Call:
    call: Call = service.stub.Attach(None)
    await call.write(_hello(sandbox_id, (await credentials.issue(sandbox_id)).credential))
    first = await call.read()
    assert isinstance(first, affinity_pb2.AttachResponse), first
    assert first.HasField("welcome"), first
    return call


async def _closed(call: Call) -> RichError:
    """The status a stream was closed with (it must be closed with one)."""
    while True:
        try:
            message = await call.read()
        except grpc.aio.AioRpcError as error:
            return decode(error)
        if message is EOF:
            raise AssertionError("the stream ended with OK, not closed with an error")


async def test_silent_streams_hold_no_slot_and_a_real_worker_attaches_past_them(
    affinity: StartAffinity, worker: StartWorker, credentials: Credentials
) -> None:
    service = await affinity(
        max_concurrent_streams=2, relay_max_waiting_for_hello=4, relay_hello_timeout_s=60
    )
    # Twice the stream limit plus the waiting limit of streams that never say Hello.
    silent: list[Call] = [service.stub.Attach(None) for _ in range(2 + 4 + 4)]
    closes = {asyncio.ensure_future(_closed(call)): call for call in silent}
    done: set[asyncio.Future[RichError]] = set()
    while len(done) < 6:  # all but the waiting limit are pushed out, oldest first
        more, _ = await asyncio.wait(
            set(closes) - done, timeout=30, return_when=asyncio.FIRST_COMPLETED
        )
        assert more, "no more silent streams were pushed out"
        done |= more
    assert len(done) == 6
    for closed in done:
        refusal = closed.result()
        assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refusal.reason == "CONCURRENCY_LIMITED"
        assert refusal.metadata == {"kind": "waiting_for_hello", "limit": "4"}
    assert _sample("turnstile_affinity_relay_streams_waiting_for_hello") == 4

    # A real worker, with four silent streams still waiting: it attaches at once.
    real = await worker(service.address, "real")
    assert "real" in await service.workers()
    second = await _welcomed(service, credentials, "second")
    # The limit counts attached streams only: a third is refused, naming that limit.
    third: Call = service.stub.Attach(None)
    await third.write(_hello("third", (await credentials.issue("third")).credential))
    refused = await _closed(third)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert {k: refused.metadata[k] for k in ("kind", "limit", "method")} == {
        "kind": "stream",
        "limit": "2",
        "method": "Attach",
    }
    # Named for its flow and level (SPEC N1): loopback plaintext's one anonymous flow.
    assert (refused.metadata["flow"], refused.metadata["level"]) == ("anonymous", "platform")
    assert "third" not in await service.workers()
    # The first newcomer found the waiting room full and pushed one more silent stream
    # out; once it attached there was room again, and three silent streams still wait.
    assert _sample("turnstile_affinity_relay_streams_waiting_for_hello") == 3
    while len(done) < 7:
        more, _ = await asyncio.wait(
            set(closes) - done, timeout=30, return_when=asyncio.FIRST_COMPLETED
        )
        assert more, "the newcomers pushed no silent stream out"
        done |= more
    assert len(done) == 7
    for call in silent:
        call.cancel()
    await asyncio.gather(*closes, return_exceptions=True)
    second.cancel()
    await real.stop()


async def test_streams_without_a_hello_are_closed_at_the_deadline_and_attached_ones_live_on(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(max_concurrent_streams=2, relay_hello_timeout_s=0.3)
    before = _sample(
        "turnstile_affinity_relay_streams_closed_before_hello_total", why="hello_timeout"
    )
    first = await _welcomed(service, credentials, "b")
    silent: list[Call] = [service.stub.Attach(None) for _ in range(4)]  # the limit and two more
    second = await _welcomed(service, credentials, "c")  # the limit's second slot is free
    for refusal in await asyncio.gather(*(_closed(call) for call in silent)):
        assert refusal.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert refusal.reason == "INVALID_FIELD"
        assert refusal.metadata == {"field": "hello", "why": "hello_timeout", "timeout_s": "0.3"}
    assert (
        _sample("turnstile_affinity_relay_streams_closed_before_hello_total", why="hello_timeout")
        == before + 4
    )
    assert _sample("turnstile_affinity_relay_streams_waiting_for_hello") == 0
    # The attached streams outlived the deadline and are still served.
    for call in (first, second):
        await call.write(HEARTBEAT)
        ack = await call.read()
        assert isinstance(ack, affinity_pb2.AttachResponse)
        assert ack.HasField("heartbeat_ack")
    assert set(await service.workers()) == {"b", "c"}
    for call in (first, second):
        call.cancel()


async def test_one_credential_replayed_on_many_streams_keeps_one_slot_and_no_worker_out(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    """Each accepted Hello of a sandbox takes its presence over; the streams it took it
    from, silent, would hold their slots until their idle timeout, so one credential
    replayed fast could fill the stream limit. A newer stream of the same sandbox on
    this replica ends the older one at once (``ABORTED``), its slot given back."""
    service = await affinity(max_concurrent_streams=3, presence_ttl_s=120.0)
    credential = (await credentials.issue("copied")).credential
    streams: list[Call] = []
    for _ in range(8):  # more than the limit, one after another, none ever heartbeats
        call: Call = service.stub.Attach(None)
        await call.write(_hello("copied", credential))
        first = await call.read()
        assert isinstance(first, affinity_pb2.AttachResponse), first
        assert first.HasField("welcome"), first
        streams.append(call)
    for older in streams[:-1]:
        refusal = await _closed(older)
        assert refusal.code == grpc.StatusCode.ABORTED
        assert refusal.metadata == {"sandbox_id": "copied"}
    # Two other sandboxes' workers attach: the replayed credential holds one slot.
    others = [await _welcomed(service, credentials, sandbox) for sandbox in ("w1", "w2")]
    assert set(await service.workers()) == {"copied", "w1", "w2"}
    for call in (*streams, *others):
        call.cancel()


async def test_a_slot_taken_at_hello_is_given_back_by_every_stream_that_ends(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(max_concurrent_streams=1)
    stale = (await credentials.issue("b")).credential
    current = (await credentials.issue("b")).credential
    for _ in range(3):  # accepted in process, refused by attach.lua: the slot was taken
        call: Call = service.stub.Attach(None)
        await call.write(_hello("b", stale))
        refused = await _closed(call)
        assert (refused.code, refused.metadata["why"]) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "revoked",
        )
    for _ in range(3):  # attached, then Goodbye
        call = service.stub.Attach(None)
        await call.write(_hello("b", current))
        first = await call.read()
        assert isinstance(first, affinity_pb2.AttachResponse)
        assert first.HasField("welcome")
        await call.write(GOODBYE)
        assert await call.code() == grpc.StatusCode.OK
    last = await _welcomed(service, credentials, "c")
    assert set(await service.workers()) == {"c"}
    last.cancel()


async def _flood(call: Call, messages: list[affinity_pb2.AttachRequest]) -> tuple[int, int, float]:
    """Write every message as fast as the stream takes them, then Goodbye; the acks
    and credential acceptances read back, and how long it took."""
    acks = accepted = 0

    async def read() -> None:
        nonlocal acks, accepted
        while (response := await call.read()) is not EOF:
            assert isinstance(response, affinity_pb2.AttachResponse)
            acks += response.HasField("heartbeat_ack")
            accepted += response.HasField("credential_accepted")

    reader = asyncio.ensure_future(read())
    started = time.monotonic()
    for message in messages:
        await call.write(message)
    await call.write(GOODBYE)
    await asyncio.wait_for(reader, 60)
    return acks, accepted, time.monotonic() - started


async def test_a_heartbeat_flood_on_one_stream_is_dropped_past_its_budget(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(
        heartbeat_interval_s=1.0,
        relay_heartbeats_per_interval=2,
        relay_heartbeat_burst=5,
    )
    call = await _welcomed(service, credentials, "b")
    dropped = _sample("turnstile_affinity_relay_messages_dropped_total", kind="heartbeat")
    acks, _, seconds = await _flood(call, [HEARTBEAT] * 2000)
    # Only the budget reached the heartbeat script (one per ack): 5 at once, 2/s after.
    assert 5 <= acks <= 5 + 2 * seconds + 1, (acks, seconds)
    assert (
        _sample("turnstile_affinity_relay_messages_dropped_total", kind="heartbeat")
        == dropped + 2000 - acks
    )


async def test_a_renewal_flood_on_one_stream_is_dropped_before_its_signature_check(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(relay_renewals_per_minute=60, relay_renewal_burst=3)
    issued = await credentials.issue("b")
    call: Call = service.stub.Attach(None)
    await call.write(_hello("b", issued.credential))
    await call.read()
    renewed = await credentials.issuer.renew("b", issued.generation)
    assert renewed is not None
    renewal = affinity_pb2.AttachRequest(
        renewal=affinity_pb2.CredentialRenewal(credential=renewed.credential)
    )
    dropped = _sample("turnstile_affinity_relay_messages_dropped_total", kind="renewal")
    _, accepted, seconds = await _flood(call, [renewal] * 1000)
    # Every renewal checked is answered (accepted, or the stream ends): 3, then 1/s.
    assert 3 <= accepted <= 3 + seconds + 1, (accepted, seconds)
    assert (
        _sample("turnstile_affinity_relay_messages_dropped_total", kind="renewal")
        == dropped + 1000 - accepted
    )


POLICY = f"""
[[allow]]
identities = ["spiffe://turnstile.test/sandbox"]
methods = ["{SERVICE}/Attach"]
"""


async def test_two_thousand_refused_hellos_write_one_line_per_identity_and_reason(
    affinity: StartAffinity,
    credentials: Credentials,
    pki: Pki,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Fresh throttles, so lines other tests wrote in this process do not count here.
    monkeypatch.setattr(attestation, "REFUSAL_LINES", LogThrottle(attestation.log))
    monkeypatch.setattr(authorizer, "REFUSAL_LOG", LogThrottle(authorizer.log))
    monkeypatch.setattr(stream_limits, "LINES", LogThrottle(stream_limits.log))
    service = await affinity(**pki.server_settings("service/affinity", policy=POLICY))
    forged = (await credentials.issue("b")).credential[:-4] + "AAAA"
    refused_before = _sample("turnstile_affinity_credential_refusals_total", why="bad_signature")
    denied_before = _sample("turnstile_authz_decisions_total", identity="other", outcome="denied")

    async def refused(channel: grpc.aio.Channel, sandbox_id: str) -> grpc.StatusCode:
        call: Any = channel.stream_stream(
            ATTACH,
            request_serializer=affinity_pb2.AttachRequest.SerializeToString,
            response_deserializer=affinity_pb2.AttachResponse.FromString,
        )(None, timeout=30)
        # Refused before the Hello is read, the write may fail: the status is what counts.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.write(_hello(sandbox_id, forged))
        return await call.code()  # type: ignore[no-any-return]

    with caplog.at_level(logging.INFO):
        async with (
            pki.identity("sandbox").channel(service.address) as sandbox,
            pki.identity("service/gateway").channel(service.address) as gateway,
        ):
            for start in range(0, 1000, 100):
                codes = await asyncio.gather(
                    *(refused(sandbox, f"sb-{i}") for i in range(start, start + 100)),
                    *(refused(gateway, f"gw-{i}") for i in range(start, start + 100)),
                )
                assert set(codes) == {grpc.StatusCode.PERMISSION_DENIED}

    credential_lines = [r for r in caplog.records if r.getMessage() == "worker credential refused"]
    authz_lines = [r for r in caplog.records if r.getMessage() == "call refused"]
    assert len(credential_lines) == 1  # one identity, one reason: one line a minute
    assert credential_lines[0].identity == "spiffe://turnstile.test/sandbox"  # type: ignore[attr-defined]
    assert len(authz_lines) == 1
    assert authz_lines[0].identity == "spiffe://turnstile.test/service/gateway"  # type: ignore[attr-defined]
    # The metrics count every refusal.
    assert (
        _sample("turnstile_affinity_credential_refusals_total", why="bad_signature")
        == refused_before + 1000
    )
    assert (
        _sample("turnstile_authz_decisions_total", identity="other", outcome="denied")
        == denied_before + 1000
    )
