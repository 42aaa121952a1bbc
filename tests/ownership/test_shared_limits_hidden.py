"""Shared limits stay hidden from tenants (SPEC N5), through the real admission and
substrate (Direct) over mutual TLS with tenant certificates: when the cluster bucket
or a node's slots refuse, or would refuse (a dry run), a tenant is told that the
cluster is contended and when to retry, never the shared limit's capacity or level;
the decision log read by the tenant says no more. An operator sees every number."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.errors import RichError, decode
from turnstile_testing.eventually import eventually

from .conftest import ADMISSION, SUBSTRATE, Tenants, client

#: The fixture's slots per node (admission's default).
SLOTS_PER_NODE = 32


def activate(sandbox_id: str, client_id: str, *, dry_run: bool) -> substrate_pb2.ActivateRequest:
    return substrate_pb2.ActivateRequest(
        sandbox_id=sandbox_id, client=client(client_id), dry_run=dry_run
    )


def admit(sandbox_id: str, client_id: str, *, dry_run: bool) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=client(client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        candidate_nodes=["n1"],
        dry_run=dry_run,
    )


async def refusal(tenants: Tenants, who: str, service: str, method: str, request: Any) -> RichError:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await tenants.call(who, service, method, request)
    error = decode(raised.value)
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    return error


def assert_hidden(error: RichError) -> None:
    """A tenant's refusal by the cluster bucket: its reason, key and retry hint, and
    nothing of the bucket's capacity (1) or level (0)."""
    assert error.reason == "RATE_LIMITED"
    assert error.message.startswith("the cluster is contended, retry in "), error.message
    assert "bucket" not in error.message
    assert " of " not in error.message
    assert error.retry_after_s is not None
    assert error.retry_after_s > 0
    assert error.metadata["key"] == "acme"
    assert not {"limit", "current", "shared_limit"} & set(error.metadata), error.metadata
    assert [(v.subject, v.description) for v in error.quota_violations] == [
        ("cluster", "the cluster is contended")
    ]


@pytest.fixture
async def spent_cluster_bucket(tenants: Tenants) -> Tenants:
    """One cluster token, taken by globex: the next activation the bucket refuses
    (it refills one token in 1,000 s)."""
    await LimitsStore(tenants.redis, tenants.redis_prefix).set_cluster(
        ClusterLimits(rate=0.001, burst=1)
    )
    await tenants.activate("globex", "globex--first", client("globex"))
    return tenants


async def test_a_tenants_dry_run_and_refusal_by_the_cluster_bucket_name_no_level(
    spent_cluster_bucket: Tenants,
) -> None:
    tenants = spent_cluster_bucket
    dry = await refusal(
        tenants, "acme", SUBSTRATE, "Activate", activate("acme--a", "acme", dry_run=True)
    )
    assert_hidden(dry)
    real = await refusal(
        tenants, "acme", SUBSTRATE, "Activate", activate("acme--a", "acme", dry_run=False)
    )
    assert_hidden(real)
    # The operator's answer to the same activation has every number.
    ops = await refusal(
        tenants, "ops", SUBSTRATE, "Activate", activate("acme--a", "acme", dry_run=True)
    )
    assert (ops.metadata["limit"], ops.metadata["current"]) == ("1", "0")
    assert ops.metadata["shared_limit"] == "cluster bucket"
    assert "cluster bucket" in ops.message


async def test_a_tenants_own_decisions_name_no_level_of_the_cluster_bucket(
    spent_cluster_bucket: Tenants,
) -> None:
    tenants = spent_cluster_bucket
    await refusal(
        tenants, "acme", SUBSTRATE, "Activate", activate("acme--a", "acme", dry_run=False)
    )
    read = admission_pb2.ListDecisionsRequest(client_id="acme", sandbox_id="acme--a")

    async def both(who: str) -> list[admission_pb2.LoggedDecision]:
        """Both services' entries of the refusal, once both are in the log."""
        page = await tenants.call(who, ADMISSION, "ListDecisions", read)
        services = {d.service for d in page.decisions}
        return list(page.decisions) if {"admission", "substrate"} <= services else []

    mine = await eventually(lambda: both("acme"))
    for entry in mine:
        for verdict in (v for v in entry.verdicts if v.policy == admission_pb2.POLICY_RATE):
            assert (verdict.limit, verdict.current) == (0, 0)
            assert verdict.detail in ("", "the cluster is contended")
        if entry.service == "substrate":
            assert entry.detail == "the cluster is contended"
        assert "bucket" not in entry.detail, entry.detail
        assert " of " not in entry.detail, entry.detail
    ops = await eventually(lambda: both("ops"))
    refused = next(e for e in ops if e.service == "admission")
    rate = next(v for v in refused.verdicts if v.policy == admission_pb2.POLICY_RATE)
    assert (rate.limit, rate.current, rate.detail) == (1, 0, "cluster bucket")
    substrate = next(e for e in ops if e.service == "substrate")
    assert "cluster bucket" in substrate.detail


async def test_a_tenants_dry_run_and_refusal_by_node_slots_name_no_count(
    tenants: Tenants,
) -> None:
    for n in range(SLOTS_PER_NODE):  # globex holds every slot of n1
        held = await tenants.call(
            "ops", ADMISSION, "Admit", admit(f"globex--{n}", "globex", dry_run=False)
        )
        assert held.decision == admission_pb2.DECISION_ADMITTED
    for dry_run in (True, False):
        answer = await tenants.call(
            "acme", ADMISSION, "Admit", admit("acme--a", "acme", dry_run=dry_run)
        )
        assert answer.decision == admission_pb2.DECISION_REFUSED
        assert answer.refused_by == admission_pb2.POLICY_NODE_SLOTS
        assert (answer.limit, answer.current) == (0, 0)
        slots = next(v for v in answer.verdicts if v.policy == admission_pb2.POLICY_NODE_SLOTS)
        assert (slots.verdict, slots.limit, slots.current) == (admission_pb2.VERDICT_REFUSE, 0, 0)
        assert slots.detail == "the cluster is contended"
        assert "the cluster is contended, retry in " in answer.message, answer.message
        assert str(SLOTS_PER_NODE) not in answer.message
        assert answer.HasField("retry_after")
    ops = await tenants.call("ops", ADMISSION, "Admit", admit("acme--a", "acme", dry_run=True))
    assert (ops.refused_by, ops.limit, ops.current) == (
        admission_pb2.POLICY_NODE_SLOTS,
        SLOTS_PER_NODE,
        SLOTS_PER_NODE,
    )
    assert f"{SLOTS_PER_NODE} of {SLOTS_PER_NODE}" in ops.message
