"""Worker attestation at the relay: a worker attaches only as its own sandbox (SPEC Z3).

Real relay over real gRPC sockets, real Redis, credentials minted by the real
issuer (the substrate's) with the test's own key pair. Sandbox B's stream is a
raw Attach stream that sends no heartbeat while impostors try, so every one of
the store's keys must stay byte for byte the same (DUMP before and after).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from turnstile_affinity.store import Keys
from turnstile_contracts import affinity_pb2
from turnstile_platform.errors import RichError, decode
from turnstile_platform.sandbox_credentials import SigningKey, now_ms
from turnstile_platform.tiers import TIER_LABEL
from turnstile_testing.authz import is_state

if TYPE_CHECKING:
    from conftest import Affinity, Credentials, StartAffinity, StartWorker

Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]
HOUR_MS = 3_600_000


def hello(sandbox_id: str, credential: str) -> affinity_pb2.AttachRequest:
    return affinity_pb2.AttachRequest(
        hello=affinity_pb2.Hello(
            sandbox_id=sandbox_id, capacity=2, labels={TIER_LABEL: "a"}, credential=credential
        )
    )


async def open_stream(service: Affinity, sandbox_id: str, credential: str) -> Call:
    call: Call = service.stub.Attach(None)
    await call.write(hello(sandbox_id, credential))
    return call


async def welcomed(service: Affinity, sandbox_id: str, credential: str) -> Call:
    call = await open_stream(service, sandbox_id, credential)
    first = await call.read()
    assert isinstance(first, affinity_pb2.AttachResponse), first
    assert first.HasField("welcome"), first
    return call


async def refusal(call: Call) -> RichError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    return decode(raised.value)


async def snapshot(redis: aioredis.Redis, keys: Keys) -> dict[bytes, bytes | None]:
    """Every key of the affinity store, byte for byte."""
    found = [k async for k in redis.scan_iter(match=f"{keys.prefix}*", count=1000)]
    return {k: await redis.dump(k) for k in sorted(found) if is_state(k)}


async def test_an_impostor_is_refused_and_the_real_workers_state_is_untouched(
    affinity: StartAffinity, credentials: Credentials, redis: aioredis.Redis
) -> None:
    service = await affinity(tiers="a")
    stale_b = (await credentials.issue("b")).credential  # an earlier runtime of b
    real_b = (await credentials.issue("b")).credential
    a = (await credentials.issue("a")).credential
    b_stream = await welcomed(service, "b", real_b)
    placed = await service.place("chat", "a")
    assert placed.sandbox_id == "b"  # a session on b, with a lease held
    await redis.set(service.keys.detached("b"), 1)  # and a detach mark to keep
    before = await snapshot(redis, service.keys)
    assert service.keys.session("chat", "acme").encode() in before

    stranger = SigningKey(Ed25519PrivateKey.generate())
    signing = SigningKey.from_file(credentials.keys.signing_key_file)
    generation = credentials.issued["b"].generation
    attempts = {
        "wrong_sandbox": a,  # sandbox a's valid credential, presented as b
        "missing": "",
        "unknown_key": stranger.mint("b", generation=generation, ttl_ms=HOUR_MS),
        "expired": signing.mint(
            "b", generation=generation, ttl_ms=HOUR_MS, issued_ms=now_ms() - 3 * HOUR_MS
        ),
        "revoked": stale_b,  # validly signed for b, but not b's current runtime
        "bad_signature": real_b[:-4] + ("AAAA" if not real_b.endswith("AAAA") else "BBBB"),
    }
    for why, credential in attempts.items():
        refused = await refusal(await open_stream(service, "b", credential))
        assert refused.code == grpc.StatusCode.PERMISSION_DENIED, why
        assert refused.reason == "WORKER_CREDENTIAL_REFUSED", why
        assert refused.metadata["why"] == why
        assert refused.metadata["sandbox_id"] == "b"
        assert await snapshot(redis, service.keys) == before, why

    # b still owns its presence and keeps serving its session.
    await b_stream.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    ack = await b_stream.read()
    assert isinstance(ack, affinity_pb2.AttachResponse)
    assert ack.HasField("heartbeat_ack")
    assert await service.release(placed)
    again = await service.place("chat", "a")
    assert (again.sandbox_id, again.outcome) == ("b", affinity_pb2.PLACEMENT_OUTCOME_HIT)
    b_stream.cancel()


async def test_a_deactivated_sandboxs_credential_stops_working_on_the_live_stream_too(
    affinity: StartAffinity, credentials: Credentials, redis: aioredis.Redis
) -> None:
    service = await affinity()
    credential = (await credentials.issue("b")).credential
    stream = await welcomed(service, "b", credential)
    await credentials.issuer.revoke("b")  # what Deactivate does

    await stream.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    ended = await refusal(stream)
    assert (ended.code, ended.metadata["why"]) == (grpc.StatusCode.PERMISSION_DENIED, "revoked")
    assert "b" not in await service.workers()  # the stream's teardown removed its presence
    assert await redis.exists(service.keys.detached("b"))

    again = await refusal(await open_stream(service, "b", credential))
    assert again.metadata["why"] == "revoked"
    assert "b" not in await service.workers()


async def test_the_same_sandbox_reconnecting_through_another_replica_attaches_at_once(
    affinity: StartAffinity, credentials: Credentials, redis: aioredis.Redis
) -> None:
    # The first replica's stream still owns a live presence (as after a relay
    # crash, before it expires); the worker's next Hello, elsewhere, proves it
    # is the same sandbox and takes the presence over on its first try.
    first, second = await affinity(), await affinity()
    credential = (await credentials.issue("b")).credential
    old = await welcomed(first, "b", credential)
    new = await welcomed(second, "b", credential)
    owner = await redis.hget(second.keys.presence("b"), "owner")
    await old.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    superseded = await refusal(old)
    assert superseded.code == grpc.StatusCode.ABORTED
    assert await redis.hget(second.keys.presence("b"), "owner") == owner  # left alone
    new.cancel()


async def test_a_renewal_extends_the_stream_and_a_renewal_for_another_sandbox_ends_it(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity()
    issued = await credentials.issue("b")
    stream = await welcomed(service, "b", issued.credential)
    renewed = await credentials.issuer.renew("b", issued.generation)
    assert renewed is not None
    renewal = affinity_pb2.CredentialRenewal(credential=renewed.credential)
    await stream.write(affinity_pb2.AttachRequest(renewal=renewal))
    accepted = await stream.read()
    assert isinstance(accepted, affinity_pb2.AttachResponse)
    assert accepted.credential_accepted.expires_at.ToMilliseconds() == renewed.expires_ms

    other = (await credentials.issue("a")).credential
    await stream.write(
        affinity_pb2.AttachRequest(renewal=affinity_pb2.CredentialRenewal(credential=other))
    )
    ended = await refusal(stream)
    assert (ended.code, ended.metadata["why"]) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "wrong_sandbox",
    )
    assert "b" not in await service.workers()


async def test_the_worker_agent_presents_its_renewed_credential_file_on_the_live_stream(
    affinity: StartAffinity, worker: StartWorker, credentials: Credentials
) -> None:
    service = await affinity()
    handle = await worker(service.address, "b")
    path = await credentials.file("b")
    renewed = await credentials.issuer.renew("b", credentials.issued["b"].generation)
    assert renewed is not None
    path.write_text(renewed.credential)  # the substrate's renewal pass
    async with asyncio.timeout(10):
        await handle.agent.renewal_accepted.wait()
    assert handle.agent.presented_credential == renewed.credential
    assert handle.agent.attached.is_set()
    assert "b" in await service.workers()


async def test_without_attestation_a_hello_never_takes_a_live_presence(
    affinity: StartAffinity, redis: aioredis.Redis
) -> None:
    service = await affinity(worker_attestation="off")
    owner = await welcomed(service, "b", "")
    taken = await refusal(await open_stream(service, "b", ""))
    assert (taken.code, taken.metadata["why"]) == (grpc.StatusCode.ABORTED, "presence_taken")
    await owner.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    ack = await owner.read()
    assert isinstance(ack, affinity_pb2.AttachResponse)
    assert ack.HasField("heartbeat_ack")
    owner.cancel()


async def test_a_credential_longer_than_the_contract_is_invalid_argument(
    affinity: StartAffinity,
) -> None:
    service = await affinity()
    refused = await refusal(await open_stream(service, "b", "x" * 2049))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations[0].field == "hello.credential"
    assert await service.workers() == {}


async def test_impostors_racing_the_real_workers_hello_never_take_its_presence(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    first, second = await affinity(), await affinity()
    real = (await credentials.issue("b")).credential
    stolen = (await credentials.issue("a")).credential

    async def impostor(n: int) -> RichError:
        return await refusal(await open_stream(second if n % 2 else first, "b", stolen))

    results = await asyncio.gather(welcomed(first, "b", real), *(impostor(n) for n in range(20)))
    stream, refused = results[0], results[1:]
    assert all(isinstance(r, RichError) and r.metadata["why"] == "wrong_sandbox" for r in refused)
    assert isinstance(stream, grpc.aio.StreamStreamCall)
    await stream.write(affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat()))
    ack = await stream.read()
    assert isinstance(ack, affinity_pb2.AttachResponse)
    assert ack.HasField("heartbeat_ack")  # still the owner
    assert "b" in await first.workers()
    stream.cancel()
