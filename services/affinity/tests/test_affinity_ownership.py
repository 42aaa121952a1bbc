"""Session ownership (SPEC O2): a session is placed only on its client's sandboxes
(and the native shared pool where the tier allows it), first turn to fallback, and
another tenant's session answers exactly like a missing one.

Real service over gRPC, real Redis, real worker agents attached with real
credentials whose presence claims name their owner (SPEC O3). Time inside the
scripts is Redis TIME plus a clock offset, so a grace period is crossed without
sleeping.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_affinity.store import Clock, Keys
from turnstile_contracts import affinity_pb2
from turnstile_platform.errors import RichError, decode
from turnstile_platform.sandbox_credentials import PresenceClaims
from turnstile_platform.tiers import TIER_LABEL
from turnstile_testing.authz import is_state

if TYPE_CHECKING:
    from conftest import Affinity, Credentials, StartAffinity, StartWorker, Worker

HIT = affinity_pb2.PLACEMENT_OUTCOME_HIT
FIRST = affinity_pb2.PLACEMENT_OUTCOME_FIRST
FALLBACK = affinity_pb2.PLACEMENT_OUTCOME_FALLBACK
GRACE_S = 30.0
ACME = {"a1", "a2"}
GLOBEX = {"g1", "g2"}


async def snapshot(redis: aioredis.Redis, keys: Keys) -> dict[bytes, bytes | None]:
    """Every key of the affinity store, byte for byte (DUMP), with its ttl bucket."""
    found = sorted([k async for k in redis.scan_iter(match=f"{keys.prefix}*", count=1000)])
    return {k: await redis.dump(k) for k in found if is_state(k)}


async def two_tenants(
    affinity: StartAffinity, worker: StartWorker, clock: Clock, **settings: Any
) -> tuple[Affinity, dict[str, Worker]]:
    """acme's a1 (capacity 4) and a2 (capacity 64), globex's g1 and g2 (capacity 256,
    idle, so always the least loaded of the tier): one tier, presence outliving the
    clock's jumps."""
    service = await affinity(clock, tiers="a", grace_s=GRACE_S, presence_ttl_s=120.0, **settings)
    workers = {
        "a1": await worker(service.address, "a1", "a", capacity=4, client="acme"),
        "a2": await worker(service.address, "a2", "a", capacity=64, client="acme"),
        "g1": await worker(service.address, "g1", "a", capacity=256, client="globex"),
        "g2": await worker(service.address, "g2", "a", capacity=256, client="globex"),
    }
    return service, workers


async def test_no_session_ever_lands_on_the_other_tenants_sandbox(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    clock = Clock()
    service, workers = await two_tenants(affinity, worker, clock)
    # A second replica on the same Redis: concurrent turns come through both.
    other = await affinity(clock, tiers="a", grace_s=GRACE_S, presence_ttl_s=120.0)
    replicas = (service, other)

    # First turns: globex's idle sandboxes are the tier's least loaded, and never used.
    acme_first = [await service.place(f"acme-{i}", "a", "acme") for i in range(4)]
    globex_first = [await service.place(f"globex-{i}", "a", "globex") for i in range(4)]
    assert {p.sandbox_id for p in acme_first} <= ACME
    assert {p.sandbox_id for p in globex_first} <= GLOBEX
    assert all(p.outcome == FIRST for p in acme_first + globex_first)
    for placed in acme_first:
        assert await service.release(placed, "acme")
    for placed in globex_first:
        assert await service.release(placed, "globex")
    # Put acme's sessions on a1: claim fresh ones until four sit there.
    on_a1 = [f"acme-{i}" for i, p in enumerate(acme_first) if p.sandbox_id == "a1"]
    n = 100
    while len(on_a1) < 4:
        placed = await service.place(f"acme-{n}", "a", "acme")
        assert placed.sandbox_id in ACME
        assert await service.release(placed, "acme")
        if placed.sandbox_id == "a1":
            on_a1.append(f"acme-{n}")
        n += 1

    # Hits stay where they were.
    for session in on_a1:
        hit = await service.place(session, "a", "acme")
        assert (hit.sandbox_id, hit.outcome) == ("a1", HIT)
        assert await service.release(hit, "acme")

    # a1 leaves: pending names a1 (the wake it may send is a1's), never a move.
    await workers["a1"].stop()
    for session in on_a1:
        pending = await service.refused(session, "a", "acme")
        assert (pending.reason, pending.metadata["sandbox_id"]) == ("SANDBOX_PENDING", "a1")

    # Past the grace: every session falls back, concurrently, through both replicas,
    # three turns each — onto acme's a2, never globex's idle sandboxes.
    clock.offset_ms += int(GRACE_S * 1000) + 1000

    async def turn(i: int, session: str) -> affinity_pb2.PlaceResponse:
        return await replicas[i % 2].place(session, "a", "acme")

    turns = [turn(i, session) for i, session in enumerate(on_a1 * 3)]
    outcomes: list[Any] = list(await asyncio.gather(*turns, return_exceptions=True))
    assert all(isinstance(p, affinity_pb2.PlaceResponse) for p in outcomes), outcomes
    responses = [p for p in outcomes if isinstance(p, affinity_pb2.PlaceResponse)]
    assert {p.sandbox_id for p in responses} == {"a2"}
    # Each session moved once: one fallback per session, the rest hits on a2.
    fallbacks = Counter(p.reset.from_sandbox_id for p in responses if p.outcome == FALLBACK)
    assert fallbacks == {"a1": len(on_a1)}
    for p in responses:
        assert await service.release(p, "acme")
    for i in range(4):  # globex's sessions never moved
        assert (await service.place(f"globex-{i}", "a", "globex")).sandbox_id in GLOBEX


async def test_with_its_own_sandboxes_full_a_tenant_is_refused_not_given_anothers(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity(tiers="a")
    await worker(service.address, "a1", "a", capacity=1, client="acme")
    await worker(service.address, "g1", "a", capacity=64, client="globex")
    held = await service.place("one", "a", "acme")
    assert held.sandbox_id == "a1"
    full = await service.refused("two", "a", "acme")
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # And concurrently, many first turns of acme: one slot, the rest refused.
    assert await service.release(held, "acme")
    results = await asyncio.gather(
        *(service.place(f"c-{i}", "a", "acme") for i in range(12)), return_exceptions=True
    )
    placed = [r for r in results if isinstance(r, affinity_pb2.PlaceResponse)]
    assert [p.sandbox_id for p in placed] == ["a1"]
    assert all(
        isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for r in results
        if not isinstance(r, affinity_pb2.PlaceResponse)
    )


def _same_refusal(a: RichError, b: RichError, a_id: str, b_id: str) -> None:
    """Two refusals are the same answer, the session ids aside."""
    assert a.code == b.code
    assert a.reason == b.reason
    assert a.message.replace(a_id, "<id>") == b.message.replace(b_id, "<id>")
    assert {k: v.replace(a_id, "<id>") for k, v in a.metadata.items()} == {
        k: v.replace(b_id, "<id>") for k, v in b.metadata.items()
    }


async def _get_session(service: Affinity, session_id: str, client: str) -> RichError:
    request = affinity_pb2.GetSessionRequest(session_id=session_id, client_id=client)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await service.stub.GetSession(request)
    return decode(raised.value)


async def test_another_tenants_session_answers_like_a_missing_one_and_changes_nothing(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    # Heartbeats rare enough that none moves a presence's expiry during the test:
    # then every key must stay byte for byte.
    service = await affinity(tiers="a,b", heartbeat_interval_s=60.0, presence_ttl_s=120.0)
    await worker(service.address, "a1", "a", capacity=4, client="acme")
    await worker(service.address, "g1", "b", capacity=4, client="globex")
    placed = await service.place("chat", "a", "acme")  # acme's session, a lease held
    assert placed.sandbox_id == "a1"
    own = await service.stub.GetSession(
        affinity_pb2.GetSessionRequest(session_id="chat", client_id="acme")
    )
    assert (own.sandbox_id, own.client_id) == ("a1", "acme")
    before = await snapshot(redis, service.keys)

    # globex has no sandbox in tier a: its turn for acme's "chat" is a first turn
    # of a session of its own, which finds nothing — as for a session never seen.
    theirs = await service.refused("chat", "a", "globex")
    missing = await service.refused("never-seen", "a", "globex")
    _same_refusal(theirs, missing, "chat", "never-seen")
    assert theirs.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # GetSession: NOT_FOUND, as a missing one.
    _same_refusal(
        await _get_session(service, "chat", "globex"),
        await _get_session(service, "never-seen", "globex"),
        "chat",
        "never-seen",
    )
    # ReleaseLease of acme's lease, for globex: not released, as a lease long gone.
    foreign = affinity_pb2.ReleaseLeaseRequest(
        sandbox_id="a1", lease_id=placed.lease_id, client_id="globex"
    )
    gone = affinity_pb2.ReleaseLeaseRequest(sandbox_id="a1", lease_id="f" * 32, client_id="globex")
    assert (await service.stub.ReleaseLease(foreign)).released is False
    assert (await service.stub.ReleaseLease(gone)).released is False
    # ListWorkers for globex shows none of acme's sandboxes.
    assert set(await service.workers("", "globex")) == {"g1"}
    assert set(await service.workers("a", "globex")) == set()
    assert await snapshot(redis, service.keys) == before

    # With a sandbox of its own in the tier, globex's "chat" is its own new session;
    # acme's record stays byte for byte, and acme's next turn is still a hit on a1.
    await worker(service.address, "g2", "a", capacity=4, client="globex")
    acme_record = await redis.dump(service.keys.session("chat", "acme"))
    fresh = await service.place("chat", "a", "globex")
    assert (fresh.sandbox_id, fresh.outcome) == ("g2", FIRST)
    assert await redis.dump(service.keys.session("chat", "acme")) == acme_record
    assert await service.release(placed, "acme")
    again = await service.place("chat", "a", "acme")
    assert (again.sandbox_id, again.outcome) == ("a1", HIT)


async def test_the_shared_pool_is_a_candidate_only_where_the_tier_says_so(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity(
        tiers="shared,private",
        tier_settings='{"shared": {"shared_pool": true}}',
    )
    for tier in ("shared", "private"):
        await worker(service.address, f"n-{tier}", tier, capacity=8, client="native")
        await worker(service.address, f"a-{tier}", tier, capacity=1, client="acme")
    # acme's own first (ties go to the client's own), then the native pool.
    first = await service.place("s1", "shared", "acme")
    second = await service.place("s2", "shared", "acme")
    assert (first.sandbox_id, second.sandbox_id) == ("a-shared", "n-shared")
    # A tier without the shared pool: acme's own, then nothing.
    assert (await service.place("p1", "private", "acme")).sandbox_id == "a-private"
    refused = await service.refused("p2", "private", "acme")
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The native pool never makes another tenant's sandbox a candidate.
    assert (await service.refused("g1", "private", "globex")).code == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert (await service.place("g1", "shared", "globex")).sandbox_id == "n-shared"
    # The platform's own sessions use the native pool.
    assert (await service.place("own", "private", "native")).sandbox_id == "n-private"


async def test_an_ownerless_sandbox_is_never_a_candidate(
    affinity: StartAffinity, worker: StartWorker, credentials: Credentials
) -> None:
    service = await affinity(tiers="a")
    old = (await credentials.issue("old", None)).credential  # no presence claims
    call = service.stub.Attach(None)
    hello = affinity_pb2.Hello(
        sandbox_id="old", capacity=8, labels={TIER_LABEL: "a"}, credential=old
    )
    await call.write(affinity_pb2.AttachRequest(hello=hello))
    welcome = await call.read()
    assert isinstance(welcome, affinity_pb2.AttachResponse)
    assert welcome.HasField("welcome")
    ownerless = await worker(service.address, "nobody", "a", capacity=8, client="")
    assert ownerless.sandbox_id == "nobody"
    assert set(await service.workers()) == {"old", "nobody"}
    for client in ("acme", "native"):
        assert (await service.refused("s", "a", client)).code == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
    call.cancel()


async def test_an_ownerless_session_is_adopted_by_the_owner_of_its_sandbox_only(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    """A session recorded before owners (``session:<id>``, no client) becomes the
    session of the first client that owns the sandbox it names; for any other client
    its id is a new session of that client's, and the old record stays as it is."""
    service = await affinity(tiers="a")
    await worker(service.address, "a1", "a", capacity=4, client="acme")
    await worker(service.address, "g1", "a", capacity=4, client="globex")
    legacy = service.keys.session("old-chat", None)
    await redis.hset(legacy, mapping={"sandbox": "a1", "tier": "a"})
    await redis.pexpire(legacy, 60_000)
    record = await redis.dump(legacy)

    theirs = await service.place("old-chat", "a", "globex")
    assert (theirs.sandbox_id, theirs.outcome) == ("g1", FIRST)
    assert await redis.dump(legacy) == record

    adopted = await service.place("old-chat", "a", "acme")
    assert (adopted.sandbox_id, adopted.outcome) == ("a1", HIT)
    assert not await redis.exists(legacy)
    owned = await redis.hgetall(service.keys.session("old-chat", "acme"))
    assert owned[b"client"] == b"acme"
    assert owned[b"sandbox"] == b"a1"


async def test_place_and_get_session_need_a_client_id(affinity: StartAffinity) -> None:
    service = await affinity(tiers="a")
    for bad, why in (("", "required"), ("unattributed", "reserved"), ("has space", "label")):
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await service.stub.Place(
                affinity_pb2.PlaceRequest(session_id="s", tier="a", client_id=bad)
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (raised.value.details() or "").startswith("client_id:")
        assert why in (raised.value.details() or "")
        # A caller reads what to send, not the project's requirement ids.
        assert "SPEC" not in (raised.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await service.stub.GetSession(
                affinity_pb2.GetSessionRequest(session_id="s", client_id=bad)
            )
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_sandbox_no_longer_its_clients_moves_the_session_with_a_reset(
    affinity: StartAffinity, worker: StartWorker, credentials: Credentials
) -> None:
    """The recorded sandbox's runtime now belongs to another client (a new runtime's
    credential names another owner): the session falls back inside its own client."""
    service = await affinity(tiers="a")
    a1 = await worker(service.address, "a1", "a", capacity=4, client="acme")
    await worker(service.address, "a2", "a", capacity=64, client="acme")
    placed = await service.place("chat", "a", "acme")
    assert placed.sandbox_id == "a1"
    assert await service.release(placed, "acme")
    await a1.stop()
    # A new runtime of a1, minted for globex (the worker fixture issues it).
    await worker(service.address, "a1", "a", capacity=4, client="globex")
    assert credentials.presences["a1"] == PresenceClaims("globex", "a", 4, "")
    moved = await service.place("chat", "a", "acme")
    assert (moved.sandbox_id, moved.outcome) == ("a2", FALLBACK)
    assert moved.reset.reason == affinity_pb2.RESET_REASON_NOT_OWNED
    assert moved.reset.from_sandbox_id == "a1"
