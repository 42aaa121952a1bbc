"""Concurrent Activates of one sandbox share one activation (SPEC N2), with real
concurrency over gRPC: the first leads (it alone reaches admission), the rest
join its outcome, and past the flow's bound of waiters a call is refused at once."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc
from prometheus_client import REGISTRY

from turnstile_contracts import common_pb2, substrate_pb2
from turnstile_platform.errors import RichError, decode
from turnstile_testing.eventually import eventually

if TYPE_CHECKING:
    from conftest import Harness, StartService


def waiting(kind: str) -> float:
    """Calls of every substrate in this process waiting on another's work, by kind."""
    value = REGISTRY.get_sample_value("turnstile_substrate_sandbox_waits", {"kind": kind})
    return value or 0.0


async def until_waiting(kind: str, count: int) -> None:
    """Until ``count`` calls wait (the substrate's own gauge: joining has no other
    sign a test can see)."""
    await eventually(lambda: waiting(kind) >= count, timeout_s=20, what=f"{count} {kind} waits")


async def outcome(call: asyncio.Future[substrate_pb2.ActivateResponse]) -> object:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        return decode(error)


def activate(harness: Harness, sandbox_id: str, client: str = "acme") -> asyncio.Task[object]:
    return asyncio.ensure_future(
        outcome(asyncio.ensure_future(harness.activate(sandbox_id, client)))
    )


def hold_admission_until(harness: Harness, release: asyncio.Event) -> None:
    """Admit waits for ``release`` (the leader sits in admission meanwhile)."""

    async def held() -> None:
        await asyncio.wait_for(release.wait(), 30)

    harness.admission.on_admit = held


async def leader_in_admission(harness: Harness, sandbox_id: str) -> asyncio.Task[object]:
    leader = activate(harness, sandbox_id)
    await in_admission(harness)
    return leader


async def in_admission(harness: Harness) -> None:
    await eventually(lambda: bool(harness.admission.admits), timeout_s=20, what="an Admit")


async def test_concurrent_activates_of_one_sandbox_share_one_admission_and_one_runtime(
    harness: Harness,
) -> None:
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    joiners = [activate(harness, "sb-1") for _ in range(8)]
    await until_waiting("join", 8)
    release.set()

    results = [await leader, *await asyncio.gather(*joiners)]

    assert all(isinstance(r, substrate_pb2.ActivateResponse) for r in results), results
    answers = [r for r in results if isinstance(r, substrate_pb2.ActivateResponse)]
    assert [r.outcome for r in answers] == [substrate_pb2.OUTCOME_CREATED] + [
        substrate_pb2.OUTCOME_ALREADY_RUNNING
    ] * 8
    assert {r.sandbox.runtime_name for r in answers} == {answers[0].sandbox.runtime_name}
    assert {r.charged_client_id for r in answers} == {"acme"}
    assert list(harness.processes()) == ["sb-1"]
    assert len(harness.admission.admits) == 1
    assert len(await harness.rows("SELECT id FROM executions")) == 1


async def test_joiners_share_the_refusal_of_the_activation_they_joined(
    harness: Harness,
) -> None:
    harness.admission.cap = 0
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    joiners = [activate(harness, "sb-1") for _ in range(5)]
    await until_waiting("join", 5)
    release.set()

    results = [await leader, *await asyncio.gather(*joiners)]

    assert all(isinstance(r, RichError) for r in results), results
    refusals = [r for r in results if isinstance(r, RichError)]
    assert {(r.code, r.reason) for r in refusals} == {
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAP_EXCEEDED")
    }
    assert len(harness.admission.admits) == 1  # asked once, answered six times
    assert harness.processes() == {}


async def test_past_its_flows_bound_a_joiner_is_refused_at_once_as_aborted(
    migrated_url: str, start_service: StartService
) -> None:
    harness = await start_service(migrated_url, activation_waiters_per_flow=2)
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    joiners = [activate(harness, "sb-1") for _ in range(2)]
    await until_waiting("join", 2)

    # Answered while the activation is still in admission.
    excess = await asyncio.gather(*(activate(harness, "sb-1") for _ in range(5)))

    assert all(isinstance(r, RichError) for r in excess), excess
    for refusal in excess:
        assert isinstance(refusal, RichError)
        assert (refusal.code, refusal.reason) == (grpc.StatusCode.ABORTED, "SANDBOX_PENDING")
        assert refusal.retry_after_s is not None
        assert refusal.retry_after_s > 0
        assert (refusal.metadata["why"], refusal.metadata["limit"]) == ("flow_full", "2")
        assert refusal.metadata["sandbox_id"] == "sb-1"
    assert not leader.done()
    release.set()
    results = [await leader, *await asyncio.gather(*joiners)]
    assert [getattr(r, "outcome", r) for r in results] == [
        substrate_pb2.OUTCOME_CREATED,
        substrate_pb2.OUTCOME_ALREADY_RUNNING,
        substrate_pb2.OUTCOME_ALREADY_RUNNING,
    ]
    assert len(harness.admission.admits) == 1


async def test_a_joiner_giving_up_leaves_the_activation_it_joined_running(
    harness: Harness,
) -> None:
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    quitter = asyncio.ensure_future(harness.activate("sb-1", "acme"))
    stayer = activate(harness, "sb-1")
    await until_waiting("join", 2)

    quitter.cancel()
    await until_waiting_below("join", 2)
    release.set()

    assert getattr(await leader, "outcome", None) == substrate_pb2.OUTCOME_CREATED
    assert getattr(await stayer, "outcome", None) == substrate_pb2.OUTCOME_ALREADY_RUNNING
    assert list(harness.processes()) == ["sb-1"]


async def until_waiting_below(kind: str, count: int) -> None:
    await eventually(lambda: waiting(kind) < count, timeout_s=20, what=f"< {count} {kind} waits")


async def test_the_leader_leaving_tells_its_joiners_to_retry_and_the_retry_activates(
    harness: Harness,
) -> None:
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = asyncio.ensure_future(harness.activate("sb-1", "acme"))
    await in_admission(harness)
    joiner = activate(harness, "sb-1")
    await until_waiting("join", 1)

    leader.cancel()
    left = await joiner

    assert isinstance(left, RichError), left
    assert (left.code, left.reason, left.metadata["why"]) == (
        grpc.StatusCode.ABORTED,
        "SANDBOX_PENDING",
        "leader_gone",
    )
    release.set()
    harness.admission.on_admit = None
    again = await harness.activate("sb-1", "acme")
    assert again.outcome == substrate_pb2.OUTCOME_CREATED
    assert [h.state for h in harness.admission.holds.values()] == ["committed"]


async def test_an_activate_asking_for_another_client_is_refused_rather_than_joining(
    harness: Harness,
) -> None:
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")

    other = await activate(harness, "sb-1", client="globex")

    assert isinstance(other, RichError), other
    assert (other.code, other.metadata["why"]) == (grpc.StatusCode.ABORTED, "other_request")
    release.set()
    assert getattr(await leader, "outcome", None) == substrate_pb2.OUTCOME_CREATED
    assert len(harness.admission.admits) == 1


async def test_a_dry_run_during_an_activation_neither_joins_nor_waits(
    harness: Harness,
) -> None:
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    harness.admission.on_admit = None  # the dry run's own Admit is answered at once

    dry = await harness.stub.Activate(
        substrate_pb2.ActivateRequest(
            sandbox_id="sb-1", client=common_pb2.ActivationClient(client_id="acme"), dry_run=True
        )
    )

    assert (dry.dry_run, dry.outcome) == (True, substrate_pb2.OUTCOME_CREATED)
    assert not leader.done()
    release.set()
    assert getattr(await leader, "outcome", None) == substrate_pb2.OUTCOME_CREATED


async def test_calls_waiting_for_a_sandboxs_lock_are_bounded_per_flow(
    migrated_url: str, start_service: StartService
) -> None:
    # A Deactivate waits for the lock the activation holds; past the bound, at once refused.
    harness = await start_service(migrated_url, activation_waiters_per_flow=1)
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    request = substrate_pb2.DeactivateRequest(sandbox_id="sb-1")
    waiter = asyncio.ensure_future(harness.stub.Deactivate(request))
    await until_waiting("lock", 1)

    refused = await harness.error(harness.stub.Deactivate(request))

    assert (refused.code, refused.reason) == (grpc.StatusCode.ABORTED, "SANDBOX_PENDING")
    assert (refused.metadata["why"], refused.metadata["wait"]) == ("flow_full", "lock")
    release.set()
    assert getattr(await leader, "outcome", None) == substrate_pb2.OUTCOME_CREATED
    assert (await waiter).stopped
    assert harness.processes() == {}


async def test_an_inherit_activate_such_as_a_wake_joins_its_records_clients_activation(
    harness: Harness,
) -> None:
    await harness.activate("sb-1", "acme")
    await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    harness.admission.admits.clear()
    release = asyncio.Event()
    hold_admission_until(harness, release)
    leader = await leader_in_admission(harness, "sb-1")
    wake = asyncio.ensure_future(
        outcome(asyncio.ensure_future(harness.activate("sb-1", harness.inherit())))
    )
    await until_waiting("join", 1)
    release.set()

    led, woken = await leader, await wake

    assert getattr(led, "outcome", led) == substrate_pb2.OUTCOME_RESTORED
    assert getattr(woken, "outcome", woken) == substrate_pb2.OUTCOME_ALREADY_RUNNING
    assert len(harness.admission.admits) == 1
