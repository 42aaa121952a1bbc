"""Attested presence (SPEC O3): owner, tier, capacity and endpoint come from the
sandbox's credential, never from the worker's Hello.

Real service over gRPC, real Redis, real credentials minted by the real issuer.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc
import pytest

from turnstile_contracts import affinity_pb2
from turnstile_platform.errors import decode
from turnstile_platform.sandbox_credentials import PresenceClaims
from turnstile_platform.tiers import TIER_LABEL

if TYPE_CHECKING:
    from conftest import Affinity, Credentials, StartAffinity, StartWorker

Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]

TIERS = {"tiers": "container,microvm", "tier_settings": '{"container": {"max_capacity": 8}}'}
#: What the substrate started: acme's sandbox in tier container, 2 turns, at 10.0.0.5.
STARTED = PresenceClaims("acme", "container", 2, "10.0.0.5:8080")
#: What a compromised sandbox says about itself.
LIES = {TIER_LABEL: "microvm", "endpoint": "169.254.169.254:80"}


async def attach(
    service: Affinity, sandbox_id: str, credential: str, labels: dict[str, str], capacity: int
) -> Call:
    call: Call = service.stub.Attach(None)
    hello = affinity_pb2.Hello(
        sandbox_id=sandbox_id, labels=labels, capacity=capacity, credential=credential
    )
    await call.write(affinity_pb2.AttachRequest(hello=hello))
    first = await call.read()
    assert isinstance(first, affinity_pb2.AttachResponse), first
    assert first.HasField("welcome"), first
    return call


def overrides(caplog: pytest.LogCaptureFixture, sandbox_id: str) -> list[str]:
    return [
        getattr(r, "why", "")
        for r in caplog.records
        if r.name == "turnstile_affinity.attested_presence"
        and getattr(r, "sandbox_id", "") == sandbox_id
    ]


async def test_a_hello_contradicting_its_credential_changes_nothing_place_returns(
    affinity: StartAffinity, credentials: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    service = await affinity(**TIERS)
    credential = (await credentials.issue("sb-evil", STARTED)).credential
    call = await attach(service, "sb-evil", credential, LIES, 1024)

    worker = (await service.workers())["sb-evil"]
    assert (worker.tier, worker.capacity, worker.client_id) == ("container", 2, "acme")
    assert worker.labels["endpoint"] == "10.0.0.5:8080"
    assert worker.labels[TIER_LABEL] == "container"
    # Not a candidate of the tier it claimed ...
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await service.place("other", "microvm")
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # ... and where it is placed, the endpoint and capacity are what the substrate started.
    placed = [await service.place(f"chat-{i}", "container") for i in range(2)]
    assert {(p.sandbox_id, p.endpoint) for p in placed} == {("sb-evil", "10.0.0.5:8080")}
    # Two turns are all it has: a third session finds no free slot.
    full = decode(await _refusal(service, "chat-2"))
    assert full.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # One throttled line per reason, however often the worker says it again.
    assert sorted(overrides(caplog, "sb-evil")) == ["capacity", "endpoint", "tier"]
    call.cancel()
    again = await attach(service, "sb-evil", credential, LIES, 1024)
    assert sorted(overrides(caplog, "sb-evil")) == ["capacity", "endpoint", "tier"]
    again.cancel()


async def _refusal(service: Affinity, session_id: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await service.place(session_id, "container")
    return raised.value


async def test_capacity_is_bounded_by_the_tiers_setting(
    affinity: StartAffinity, credentials: Credentials, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    service = await affinity(**TIERS)
    big = PresenceClaims("acme", "container", 50, "")
    credential = (await credentials.issue("sb-big", big)).credential
    call = await attach(service, "sb-big", credential, {TIER_LABEL: "container"}, 50)
    assert (await service.workers())["sb-big"].capacity == 8
    assert overrides(caplog, "sb-big") == ["capacity_bound"]
    call.cancel()


async def test_a_replayed_credential_takes_the_same_presence_and_cannot_redirect_turns(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(**TIERS)
    credential = (await credentials.issue("sb-a", STARTED)).credential
    real = await attach(service, "sb-a", credential, {TIER_LABEL: "container"}, 2)
    first = await service.place("chat", "container")
    assert (first.sandbox_id, first.endpoint) == ("sb-a", "10.0.0.5:8080")
    assert await service.release(first)

    # The same credential from a second connection, claiming another endpoint.
    replay = await attach(service, "sb-a", credential, LIES, 1024)
    worker = (await service.workers())["sb-a"]
    assert (worker.tier, worker.capacity, worker.labels["endpoint"]) == (
        "container",
        2,
        "10.0.0.5:8080",
    )
    for _ in range(3):
        placed = await service.place("chat", "container")
        assert (placed.sandbox_id, placed.endpoint) == ("sb-a", "10.0.0.5:8080")
        assert await service.release(placed)
    # The replay took the presence over (the old stream, on this replica, ends
    # superseded at once): that is all.
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await real.read()
    assert raised.value.code() == grpc.StatusCode.ABORTED
    replay.cancel()


async def test_an_old_credential_without_presence_claims_is_an_ownerless_sandbox(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(**TIERS)
    old = (await credentials.issue("sb-old", None)).credential
    call = await attach(service, "sb-old", old, {TIER_LABEL: "container", "endpoint": "e:1"}, 9)
    worker = (await service.workers())["sb-old"]
    # The Hello's tier and endpoint, its capacity bounded; and no owner.
    assert (worker.tier, worker.capacity, worker.client_id) == ("container", 8, "")
    assert worker.labels["endpoint"] == "e:1"
    call.cancel()


async def test_a_renewal_attesting_a_new_endpoint_moves_where_place_points(
    affinity: StartAffinity, credentials: Credentials
) -> None:
    service = await affinity(**TIERS)
    unbound = PresenceClaims("acme", "container", 2, "")  # a cold pod before it has an IP
    credential = (await credentials.issue("sb-k", unbound)).credential
    call = await attach(service, "sb-k", credential, {TIER_LABEL: "container"}, 2)
    placed = await service.place("chat", "container")
    assert placed.endpoint == ""
    assert await service.release(placed)

    credentials.presences["sb-k"] = PresenceClaims("acme", "container", 2, "10.1.2.3:8080")
    renewed = await credentials.renew("sb-k")
    assert renewed is not None
    await call.write(
        affinity_pb2.AttachRequest(
            renewal=affinity_pb2.CredentialRenewal(credential=renewed.credential)
        )
    )
    accepted = await call.read()
    assert isinstance(accepted, affinity_pb2.AttachResponse)
    assert accepted.HasField("credential_accepted")
    placed = await service.place("chat", "container")
    assert (placed.sandbox_id, placed.endpoint) == ("sb-k", "10.1.2.3:8080")
    call.cancel()


async def test_a_lying_sandbox_is_never_returned_for_another_tenants_session(
    affinity: StartAffinity, credentials: Credentials, worker: StartWorker
) -> None:
    """The finding, end to end: a sandbox activated in tier container says microvm,
    1024 slots and the metadata service's address; other tenants' Place calls (in
    either tier) never get it, nor that address."""
    service = await affinity(**TIERS)
    credential = (await credentials.issue("sb-evil", STARTED)).credential  # acme's
    call = await attach(service, "sb-evil", credential, LIES, 1024)
    await worker(service.address, "g-micro", "microvm", capacity=8, client="globex")
    await worker(service.address, "g-cont", "container", capacity=8, client="globex")
    for i in range(5):
        tier = ("microvm", "container")[i % 2]
        placed = await service.place(f"globex-{i}", tier, "globex")
        assert placed.sandbox_id == {"microvm": "g-micro", "container": "g-cont"}[tier]
        assert placed.endpoint != "169.254.169.254:80"
        assert await service.release(placed, "globex")
    workers = await service.workers("", "globex")
    assert set(workers) == {"g-micro", "g-cont"}
    call.cancel()
