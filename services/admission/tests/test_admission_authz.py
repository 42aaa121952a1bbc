"""Authorization of every admission RPC over mTLS (SPEC Z1, Z2): the allowed identity
is served, another identity gets PERMISSION_DENIED, a certificate without an identity
gets UNAUTHENTICATED, and Redis is unchanged after each refusal. Client ids are
scoped: an identity allowed only ``self`` or a list acts for no other client."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_testing.authz import Invoke, authorized, outcome, redis_snapshot, refusal, unary
from turnstile_testing.eventually import eventually
from turnstile_testing.pki import Pki

SERVICE = "turnstile.admission.v1.AdmissionService"
TD = "spiffe://turnstile.test"

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/substrate"]
methods = ["{SERVICE}/*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = [
  "{SERVICE}/Admit", "{SERVICE}/GetUsage", "{SERVICE}/ReleaseSandbox", "{SERVICE}/ListDecisions"
]
clients = "self"

[[allow]]
identities = ["{TD}/client/ops"]
methods = ["{SERVICE}/GetUsage"]
clients = ["acme", "globex"]

[[allow]]
identities = ["{TD}/service/affinity"]
methods = ["turnstile.substrate.v1.SubstrateService/Activate"]
clients = "any"
"""


def _client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


def _admit(client_id: str, sandbox_id: str = "sb-1") -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=_client(client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
    )


CALLS: dict[str, Invoke] = {
    "Admit": unary(f"/{SERVICE}/Admit", _admit("acme")),
    "CommitHold": unary(f"/{SERVICE}/CommitHold", admission_pb2.CommitHoldRequest(hold_id="h")),
    "CancelHold": unary(f"/{SERVICE}/CancelHold", admission_pb2.CancelHoldRequest(hold_id="h")),
    "ReleaseSandbox": unary(
        f"/{SERVICE}/ReleaseSandbox", admission_pb2.ReleaseSandboxRequest(sandbox_id="sb-1")
    ),
    "GetUsage": unary(
        f"/{SERVICE}/GetUsage", admission_pb2.GetUsageRequest(client=_client("acme"))
    ),
    "ListDecisions": unary(
        f"/{SERVICE}/ListDecisions", admission_pb2.ListDecisionsRequest(client_id="acme")
    ),
    "GetQueuePosition": unary(
        f"/{SERVICE}/GetQueuePosition",
        admission_pb2.GetQueuePositionRequest(client=_client("acme"), wait_id="w-1"),
    ),
    "ReserveWarm": unary(
        f"/{SERVICE}/ReserveWarm",
        admission_pb2.ReserveWarmRequest(tier="container", pod_name="warm-1"),
    ),
}


def test_the_table_covers_every_method() -> None:
    descriptor = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"]
    assert set(CALLS) == {m.name for m in descriptor.methods}


@pytest.fixture
async def secured(start_admission: Any, pki: Pki) -> Any:
    return await start_admission(
        client_allowlist=("acme", "globex"),
        **pki.server_settings("service/admission", policy=POLICY),
    )


@pytest.mark.parametrize("method", sorted(CALLS))
async def test_every_rpc_serves_the_allowed_and_refuses_the_rest_changing_nothing(
    method: str, secured: Any, pki: Pki, redis: aioredis.Redis
) -> None:
    address = secured.app.address
    invoke = CALLS[method]
    async with pki.identity("service/affinity").channel(address) as other:
        before = await redis_snapshot(redis, secured.settings.redis_prefix)
        code, reason, metadata = await refusal(other, invoke)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert metadata == {"identity": f"{TD}/service/affinity", "method": f"{SERVICE}/{method}"}
        assert await redis_snapshot(redis, secured.settings.redis_prefix) == before
    async with pki.identity(None).channel(address) as anonymous:
        code, reason, _ = await refusal(anonymous, invoke)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
        assert await redis_snapshot(redis, secured.settings.redis_prefix) == before
    async with pki.identity("service/substrate").channel(address) as allowed:
        assert await authorized(allowed, invoke)


async def test_self_scoped_clients_act_only_for_themselves(
    secured: Any, pki: Pki, redis: aioredis.Redis
) -> None:
    address = secured.app.address
    async with pki.identity("client/acme").channel(address) as acme:
        # Its own client, an id in its own namespace (SPEC O1).
        assert await outcome(acme, unary(f"/{SERVICE}/Admit", _admit("acme", "acme--sb-1"))) == (
            grpc.StatusCode.OK
        )
        before = await redis_snapshot(redis, secured.settings.redis_prefix)
        for invoke in (
            unary(f"/{SERVICE}/Admit", _admit("globex", "sb-2")),
            # Admission keeps no owner record: a scoped Admit names ids of its namespace.
            unary(f"/{SERVICE}/Admit", _admit("acme", "globex--sb-1")),
            unary(f"/{SERVICE}/Admit", _admit("acme", "sb-1")),
            unary(f"/{SERVICE}/GetUsage", admission_pb2.GetUsageRequest(client=_client("globex"))),
            # Admission keeps no sandbox owner: a scoped identity cannot prove it owns one.
            unary(
                f"/{SERVICE}/ReleaseSandbox", admission_pb2.ReleaseSandboxRequest(sandbox_id="sb-1")
            ),
        ):
            code, _, metadata = await refusal(acme, invoke)
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert metadata["identity"] == f"{TD}/client/acme"
        assert await redis_snapshot(redis, secured.settings.redis_prefix) == before


async def test_a_nested_or_reserved_client_identity_acts_for_no_one(
    secured: Any, pki: Pki, redis: aioredis.Redis
) -> None:
    """``self`` is one exact segment of the template (SPEC O5): ``client/acme/globex``
    acts neither for globex (its last segment) nor for acme, and ``client/native``
    not for the platform's shared key."""
    address = secured.app.address
    before = await redis_snapshot(redis, secured.settings.redis_prefix)
    for path, clients in (
        ("client/acme/globex", ("globex", "acme")),
        ("client/native", ("native",)),
    ):
        async with pki.identity(path).channel(address) as nested:
            for client_id in clients:
                for invoke in (
                    unary(f"/{SERVICE}/Admit", _admit(client_id, "sb-n")),
                    unary(
                        f"/{SERVICE}/GetUsage",
                        admission_pb2.GetUsageRequest(client=_client(client_id)),
                    ),
                ):
                    code, _, metadata = await refusal(nested, invoke)
                    assert code == grpc.StatusCode.PERMISSION_DENIED, (path, client_id)
                    assert metadata["identity"] == f"{TD}/{path}"
    assert await redis_snapshot(redis, secured.settings.redis_prefix) == before


async def test_a_listed_scope_reads_usage_of_the_listed_clients_only(
    secured: Any, pki: Pki
) -> None:
    async with pki.identity("client/ops").channel(secured.app.address) as ops:
        for client_id in ("acme", "globex", "ops"):
            request = admission_pb2.GetUsageRequest(client=_client(client_id))
            assert await outcome(ops, unary(f"/{SERVICE}/GetUsage", request)) == (
                grpc.StatusCode.OK
            )
        request = admission_pb2.GetUsageRequest(client=_client("initech"))
        code, _, _ = await refusal(ops, unary(f"/{SERVICE}/GetUsage", request))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # The list does not extend to Admit: that rule grants GetUsage alone.
        code, _, _ = await refusal(ops, unary(f"/{SERVICE}/Admit", _admit("acme", "sb-9")))
        assert code == grpc.StatusCode.PERMISSION_DENIED


async def test_plaintext_is_refused_by_the_secured_service(secured: Any) -> None:
    async with grpc.aio.insecure_channel(secured.app.address) as plaintext:
        assert await outcome(plaintext, CALLS["GetUsage"]) == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_from_another_ca_is_refused(secured: Any, pki: Pki) -> None:
    stranger = Pki(pki.directory / "stranger").identity("service/substrate")
    async with stranger.channel(secured.app.address) as channel:
        assert await outcome(channel, CALLS["GetUsage"]) == grpc.StatusCode.UNAVAILABLE


async def test_a_tenant_reads_its_own_decisions_only(secured: Any, pki: Pki) -> None:
    """ListDecisions is client-scoped like GetUsage (SPEC Q3, O1): a ``self`` identity
    reads its own client's entries, never another tenant's nor every client's."""
    address = secured.app.address
    async with (
        pki.identity("client/acme").channel(address) as acme_channel,
        pki.identity("service/substrate").channel(address) as substrate_channel,
    ):
        acme: Any = admission_pb2_grpc.AdmissionServiceStub(acme_channel)
        substrate: Any = admission_pb2_grpc.AdmissionServiceStub(substrate_channel)
        await acme.Admit(_admit("acme", "acme--sb-1"))
        await substrate.Admit(_admit("globex", "globex--sb-1"))
        own = await acme.ListDecisions(admission_pb2.ListDecisionsRequest(client_id="acme"))
        assert [(d.sandbox_id, d.client) for d in own.decisions] == [("acme--sb-1", "acme")]
        # The caller's identity is in the entry.
        assert own.decisions[0].identity == f"{TD}/client/acme"
        # Another tenant's sandbox under its own client filter: nothing of globex's.
        other = await acme.ListDecisions(
            admission_pb2.ListDecisionsRequest(client_id="acme", sandbox_id="globex--sb-1")
        )
        assert list(other.decisions) == []
        for request in (
            admission_pb2.ListDecisionsRequest(),  # every client's
            admission_pb2.ListDecisionsRequest(client_id="globex"),
            admission_pb2.ListDecisionsRequest(sandbox_id="globex--sb-1"),
        ):
            code, _, _ = await refusal(acme_channel, unary(f"/{SERVICE}/ListDecisions", request))
            assert code == grpc.StatusCode.PERMISSION_DENIED
        # The operator-side identity (any client) reads both.
        every = await substrate.ListDecisions(admission_pb2.ListDecisionsRequest())
        assert {d.client for d in every.decisions} == {"acme", "globex"}


REPO = Path(__file__).resolve().parents[3]
SHIPPED_POLICIES = (
    "deploy/kustomize/base/authz-policy.toml",
    "tools/turnstilectl/src/turnstile_cli/stack/authz-policy.toml",
)


@pytest.mark.parametrize("policy_file", SHIPPED_POLICIES)
async def test_the_shipped_policies_let_only_the_substrate_reserve_warm_pods(
    policy_file: str, start_admission: Any, tmp_path: Path, redis: aioredis.Redis
) -> None:
    """The warm-pool refill's reservation (SPEC W3) names no client: a tenant, the
    gateway or affinity calling it would spend the cluster bucket for no one."""
    shipped = Pki(tmp_path / "pki", trust_domain="turnstile.local")
    admission = await start_admission(
        client_allowlist=("acme",),
        **shipped.server_settings("service/admission", policy=(REPO / policy_file).read_text()),
    )
    address = admission.app.address
    invoke = CALLS["ReserveWarm"]
    prefix = admission.settings.redis_prefix
    for other in ("client/acme", "service/gateway", "service/affinity", "sandbox"):
        async with shipped.identity(other).channel(address) as channel:
            before = await redis_snapshot(redis, prefix)
            code, reason, _ = await refusal(channel, invoke)
            assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"), other
            assert await redis_snapshot(redis, prefix) == before
    async with shipped.identity("service/substrate").channel(address) as substrate:
        assert await outcome(substrate, invoke) == grpc.StatusCode.OK


async def _waiting(stub: Any, request: admission_pb2.GetQueuePositionRequest) -> bool:
    found = await stub.GetQueuePosition(request)
    return bool(found.state == admission_pb2.QUEUE_STATE_WAITING)


@pytest.mark.parametrize("policy_file", SHIPPED_POLICIES)
async def test_the_shipped_policies_show_a_tenant_its_own_waits_only(
    policy_file: str, start_admission: Any, tmp_path: Path, redis: aioredis.Redis
) -> None:
    """GetQueuePosition is client-scoped like GetUsage (SPEC Q1, O1): a tenant sees
    where its own waiting call stands; asking for another client's is refused, and
    the same wait_id under its own client is not found, never the other's place."""
    shipped = Pki(tmp_path / "pki", trust_domain="turnstile.local")
    admission = await start_admission(
        client_allowlist=("acme", "globex"),
        rate={"cluster_rate_per_s": 0.001, "cluster_burst": 1},
        queue={"tick_interval_s": 0.01},
        **shipped.server_settings("service/admission", policy=(REPO / policy_file).read_text()),
    )
    address = admission.app.address
    mine = admission_pb2.GetQueuePositionRequest(client=_client("acme"), wait_id="w-1")
    theirs = admission_pb2.GetQueuePositionRequest(client=_client("globex"), wait_id="w-1")
    async with (
        shipped.identity("service/substrate").channel(address) as substrate_channel,
        shipped.identity("client/acme").channel(address) as acme_channel,
        shipped.identity("client/globex").channel(address) as globex_channel,
    ):
        substrate: Any = admission_pb2_grpc.AdmissionServiceStub(substrate_channel)
        acme: Any = admission_pb2_grpc.AdmissionServiceStub(acme_channel)
        globex: Any = admission_pb2_grpc.AdmissionServiceStub(globex_channel)
        await substrate.Admit(_admit("acme", "acme--first"))  # the bucket's one token
        request = _admit("acme", "acme--sb-1")
        request.wait_budget.FromSeconds(20)
        request.wait_id = "w-1"
        call = asyncio.ensure_future(substrate.Admit(request, timeout=30))
        try:
            await eventually(partial(_waiting, acme, mine), what="acme sees its wait")
            assert (await acme.GetQueuePosition(mine)).position == 1
            code, _, _ = await refusal(globex_channel, unary(f"/{SERVICE}/GetQueuePosition", mine))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            found = await globex.GetQueuePosition(theirs)
            assert found.state == admission_pb2.QUEUE_STATE_NOT_FOUND
            assert not found.HasField("waited")
        finally:
            call.cancel()


ADMIN = "turnstile.admission.v1.AdminService"
_ACME = admission_pb2.LimitsTarget(client=_client("acme"))
_GLOBEX = admission_pb2.LimitsTarget(client=_client("globex"))
#: What a tenant once did through the CLI (its own level and weight, another's cap), and
#: every other admin method once.
ADMIN_CALLS: dict[str, Invoke] = {
    "GetLimits": unary(f"/{ADMIN}/GetLimits", admission_pb2.GetLimitsRequest()),
    "SetLimits": unary(
        f"/{ADMIN}/SetLimits",
        admission_pb2.SetLimitsRequest(target=_GLOBEX, limits=admission_pb2.Limits(cap=0)),
    ),
    "PatchLimits": unary(
        f"/{ADMIN}/PatchLimits",
        admission_pb2.PatchLimitsRequest(
            target=_ACME,
            limits=admission_pb2.Limits(weight=50, level=admission_pb2.PRIORITY_LEVEL_PLATFORM),
        ),
    ),
    "DeleteLimits": unary(
        f"/{ADMIN}/DeleteLimits", admission_pb2.DeleteLimitsRequest(target=_ACME)
    ),
    "GetKeySet": unary(f"/{ADMIN}/GetKeySet", admission_pb2.GetKeySetRequest()),
    "UpdateKeySet": unary(
        f"/{ADMIN}/UpdateKeySet", admission_pb2.UpdateKeySetRequest(remove=["globex"])
    ),
}


def test_the_admin_table_covers_every_method() -> None:
    descriptor = admission_pb2.DESCRIPTOR.services_by_name["AdminService"]
    assert set(ADMIN_CALLS) == {m.name for m in descriptor.methods}


@pytest.mark.parametrize("method", sorted(ADMIN_CALLS))
@pytest.mark.parametrize("policy_file", SHIPPED_POLICIES)
async def test_the_shipped_policies_let_only_operators_call_the_admin_api(
    policy_file: str, method: str, start_admission: Any, tmp_path: Path, redis: aioredis.Redis
) -> None:
    """Limits and the key set are the platform's (SPEC M1): a tenant, the substrate,
    the gateway, affinity and a sandbox are refused and change nothing."""
    shipped = Pki(tmp_path / "pki", trust_domain="turnstile.local")
    admission = await start_admission(
        client_allowlist=("acme", "globex"),
        **shipped.server_settings("service/admission", policy=(REPO / policy_file).read_text()),
    )
    address = admission.app.address
    prefix = admission.settings.redis_prefix
    invoke = ADMIN_CALLS[method]
    for other in (
        "client/acme",
        "service/substrate",
        "service/gateway",
        "service/affinity",
        "sandbox",
    ):
        async with shipped.identity(other).channel(address) as channel:
            before = await redis_snapshot(redis, prefix)
            code, reason, metadata = await refusal(channel, invoke)
            assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED"), other
            assert metadata["method"] == f"{ADMIN}/{method}"
            assert await redis_snapshot(redis, prefix) == before
    async with shipped.identity("operator/ops").channel(address) as operator:
        assert await outcome(operator, invoke) == grpc.StatusCode.OK


async def test_a_policy_granting_a_tenant_the_admin_api_still_refuses_it(
    start_admission: Any, pki: Pki, redis: aioredis.Redis
) -> None:
    """Every admin method acts for every client: a ``self`` or listed scope is not
    enough, whatever the rule grants, so a misgranted tenant cannot set its own
    level or another's cap."""
    policy = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/client/*"]
methods = ["{ADMIN}/*"]
clients = "self"

[[allow]]
identities = ["{TD}/client/lister"]
methods = ["{ADMIN}/*"]
clients = ["acme", "globex"]
"""
    admission = await start_admission(
        client_allowlist=("acme",), **pki.server_settings("service/admission", policy=policy)
    )
    prefix = admission.settings.redis_prefix
    before = await redis_snapshot(redis, prefix)
    for who in ("client/acme", "client/lister"):
        async with pki.identity(who).channel(admission.app.address) as channel:
            for method, invoke in ADMIN_CALLS.items():
                code, _, _ = await refusal(channel, invoke)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (who, method)
    assert await redis_snapshot(redis, prefix) == before
