"""Dry runs change nothing (SPEC Q4): ``Activate`` and ``Admit`` with ``dry_run``
through the real substrate (Direct) and admission, with every Redis key under the
prefix, every PostgreSQL row and the running runtimes snapshotted before and after
each; a dry run still answers what the activation would do, refuses as it would,
and checks ownership as a real one does."""

from __future__ import annotations

import grpc
import pytest

from turnstile_clientkeys.limits import LimitsStore
from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.decision_log import key_stream

from .conftest import ADMISSION, SUBSTRATE, Tenants, client


def dry(sandbox_id: str, client_id: str) -> substrate_pb2.ActivateRequest:
    return substrate_pb2.ActivateRequest(
        sandbox_id=sandbox_id, client=client(client_id), dry_run=True
    )


async def test_a_dry_run_activate_answers_what_would_happen_and_changes_nothing(
    tenants: Tenants,
) -> None:
    await tenants.activate("acme", "acme--stopped", client("acme"))
    await tenants.deactivate("acme", "acme--stopped")
    await tenants.activate("acme", "acme--running", client("acme"))
    before = await tenants.snapshot()
    log = key_stream(tenants.redis_prefix, "acme")  # acme's stream of the log (SPEC N3)
    logged = await tenants.redis.xlen(log)
    expected = {
        "acme--new": substrate_pb2.OUTCOME_CREATED,
        "acme--stopped": substrate_pb2.OUTCOME_RESTORED,
        "acme--running": substrate_pb2.OUTCOME_ALREADY_RUNNING,
    }
    for sandbox_id, outcome in expected.items():
        answer = await tenants.call("acme", SUBSTRATE, "Activate", dry(sandbox_id, "acme"))
        assert (answer.outcome, answer.dry_run) == (outcome, True), sandbox_id
        assert answer.sandbox.sandbox_id == sandbox_id
    new = await tenants.call("acme", SUBSTRATE, "Activate", dry("acme--new", "acme"))
    assert new.charged_client_id == "acme"
    assert new.key.key == "acme"
    # Admission's own dry run, a cold create on a node, changes nothing either.
    admit = admission_pb2.AdmitRequest(
        sandbox_id="acme--x",
        client=client("acme"),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        candidate_nodes=["n1"],
        dry_run=True,
    )
    answer = await tenants.call("ops", ADMISSION, "Admit", admit)
    assert (answer.decision, answer.dry_run, answer.hold_id, answer.node) == (
        admission_pb2.DECISION_ADMITTED,
        True,
        "",
        "n1",
    )
    assert (await tenants.snapshot()).changes_since(before) == {}
    # Nor did any of them write to the decision log, which snapshots leave out.
    assert await tenants.redis.xlen(log) == logged


async def test_a_dry_run_is_refused_as_the_activation_would_be_and_changes_nothing(
    tenants: Tenants,
) -> None:
    await tenants.activate("acme", "acme--mine", client("acme"))
    await LimitsStore(tenants.redis, tenants.redis_prefix).put("key:acme", {"concurrency": 0})
    before = await tenants.snapshot()
    log = key_stream(tenants.redis_prefix, "acme")  # acme's stream of the log (SPEC N3)
    logged = await tenants.redis.xlen(log)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await tenants.call("acme", SUBSTRATE, "Activate", dry("acme--second", "acme"))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Ownership is checked as a real Activate checks it.
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await tenants.call("globex", SUBSTRATE, "Activate", dry("acme--mine", "globex"))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (await tenants.snapshot()).changes_since(before) == {}
    assert await tenants.redis.xlen(log) == logged
