"""A tenant against another's sandboxes (SPEC O1): every substrate and admission RPC that
names a sandbox or a client, called by ``acme`` on ``globex``'s stopped, running and
missing sandboxes (namespaced, and old ids outside any namespace) and on sandboxes the
platform recorded to ``globex`` inside ``acme``'s own namespace. Each is refused, every
target of one call with the same answer (so no answer says whether the id exists or
whose it is), and Redis, PostgreSQL and the runtimes are byte for byte unchanged.
Afterwards globex still owns and reaches all of its sandboxes."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.errors import decode

from .conftest import ADMIN, ADMISSION, INHERIT, SUBSTRATE, TD, Tenants, client, rows

pytestmark = pytest.mark.timeout(120)

NATIVE = common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())

#: What each target is, by sandbox id.
TARGETS = {
    "globex--stopped": "globex's, stopped",
    "globex--running": "globex's, running",
    "globex--missing": "in globex's namespace, does not exist",
    "legacy-stopped": "globex's (an id of no namespace), stopped",
    "legacy-running": "globex's (an id of no namespace), running",
    "legacy-missing": "an id of no namespace, does not exist",
    "acme--planted-running": "in acme's namespace, recorded to globex by the platform, running",
    "acme--planted-stopped": "in acme's namespace, recorded to globex by the platform, stopped",
}
#: Reads and stops act for the recorded client alone: an id of acme's own namespace
#: that does not exist is refused like the rest (Activate would create it).
READ_TARGETS = {**TARGETS, "acme--missing": "in acme's namespace, does not exist"}
#: Admission keeps no owner record: for it, an id in acme's namespace is acme's.
ADMIT_TARGETS = {k: v for k, v in TARGETS.items() if not k.startswith("acme--")}


def _activate(charged: common_pb2.ActivationClient) -> Any:
    return lambda sandbox: (
        SUBSTRATE,
        "Activate",
        substrate_pb2.ActivateRequest(sandbox_id=sandbox, client=charged),
    )


def _admit(client_id: str) -> Any:
    return lambda sandbox: (
        ADMISSION,
        "Admit",
        admission_pb2.AdmitRequest(
            sandbox_id=sandbox,
            client=client(client_id),
            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        ),
    )


#: name → (targets, request builder, whether the caller itself names globex).
SANDBOX_CALLS: dict[str, tuple[dict[str, str], Any, bool]] = {
    "Activate client=acme": (TARGETS, _activate(client("acme")), False),
    "Activate client=globex": (TARGETS, _activate(client("globex")), True),
    "Activate inherit": (READ_TARGETS, _activate(INHERIT), False),
    "Activate native": (TARGETS, _activate(NATIVE), False),
    "Deactivate": (
        READ_TARGETS,
        lambda s: (SUBSTRATE, "Deactivate", substrate_pb2.DeactivateRequest(sandbox_id=s)),
        False,
    ),
    "GetSandbox": (
        READ_TARGETS,
        lambda s: (SUBSTRATE, "GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id=s)),
        False,
    ),
    "CountLiveSandboxes": (
        READ_TARGETS,
        lambda s: (
            SUBSTRATE,
            "CountLiveSandboxes",
            substrate_pb2.CountLiveSandboxesRequest(key="globex", exclude_sandbox_id=s),
        ),
        True,
    ),
    "Admit client=acme": (ADMIT_TARGETS, _admit("acme"), False),
    "Admit client=globex": (ADMIT_TARGETS, _admit("globex"), True),
    "ReleaseSandbox": (
        READ_TARGETS,
        lambda s: (ADMISSION, "ReleaseSandbox", admission_pb2.ReleaseSandboxRequest(sandbox_id=s)),
        False,
    ),
}
CLIENT_CALLS: dict[str, tuple[str, str, Any]] = {
    "ListSandboxes client_id=globex": (
        SUBSTRATE,
        "ListSandboxes",
        substrate_pb2.ListSandboxesRequest(client_id="globex"),
    ),
    "ListSandboxes every client": (
        SUBSTRATE,
        "ListSandboxes",
        substrate_pb2.ListSandboxesRequest(),
    ),
    "GetUsage client=globex": (
        ADMISSION,
        "GetUsage",
        admission_pb2.GetUsageRequest(client=client("globex")),
    ),
    "GetUsage inherit": (ADMISSION, "GetUsage", admission_pb2.GetUsageRequest(client=INHERIT)),
    "GetQueuePosition client=globex": (
        ADMISSION,
        "GetQueuePosition",
        admission_pb2.GetQueuePositionRequest(client=client("globex"), wait_id="w-1"),
    ),
    "GetQueuePosition inherit": (
        ADMISSION,
        "GetQueuePosition",
        admission_pb2.GetQueuePositionRequest(client=INHERIT, wait_id="w-1"),
    ),
    # The admin API (SPEC M1) is the platform's: acme may neither raise its own
    # level and weight nor cut globex's cap, nor read or change the key set.
    "PatchLimits acme level platform, weight 50": (
        ADMIN,
        "PatchLimits",
        admission_pb2.PatchLimitsRequest(
            target=admission_pb2.LimitsTarget(client=client("acme")),
            limits=admission_pb2.Limits(weight=50, level=admission_pb2.PRIORITY_LEVEL_PLATFORM),
        ),
    ),
    "SetLimits globex cap 0": (
        ADMIN,
        "SetLimits",
        admission_pb2.SetLimitsRequest(
            target=admission_pb2.LimitsTarget(client=client("globex")),
            limits=admission_pb2.Limits(cap=0),
        ),
    ),
    "DeleteLimits globex": (
        ADMIN,
        "DeleteLimits",
        admission_pb2.DeleteLimitsRequest(
            target=admission_pb2.LimitsTarget(client=client("globex"))
        ),
    ),
    "GetLimits every key": (ADMIN, "GetLimits", admission_pb2.GetLimitsRequest()),
    "GetKeySet": (ADMIN, "GetKeySet", admission_pb2.GetKeySetRequest(client_ids=["globex"])),
    "UpdateKeySet remove globex": (
        ADMIN,
        "UpdateKeySet",
        admission_pb2.UpdateKeySetRequest(remove=["globex"]),
    ),
}


def test_the_client_calls_cover_every_admin_method() -> None:
    admin = admission_pb2.DESCRIPTOR.services_by_name["AdminService"]
    assert {m.name for m in admin.methods} <= {
        method for service, method, _ in CLIENT_CALLS.values() if service == ADMIN
    }


async def _world(tenants: Tenants) -> None:
    """globex's sandboxes made through the services themselves (and the platform's)."""
    globex, ops = client("globex"), "ops"
    await tenants.activate("globex", "globex--running", globex)
    await tenants.activate("globex", "globex--stopped", globex)
    await tenants.deactivate("globex", "globex--stopped")
    for who, sandbox in (
        (ops, "legacy-running"),
        (ops, "legacy-stopped"),
        (ops, "acme--planted-running"),
        (ops, "acme--planted-stopped"),
    ):
        await tenants.activate(who, sandbox, globex)
    await tenants.deactivate(ops, "legacy-stopped")
    await tenants.deactivate(ops, "acme--planted-stopped")
    await tenants.activate("acme", "acme--mine", client("acme"))


def _answer(error: grpc.aio.AioRpcError, sandbox: str) -> tuple[Any, ...]:
    """Everything a refusal says, with the id the caller sent written ``<id>``."""
    rich = decode(error)
    return (
        rich.code,
        rich.message.replace(repr(sandbox), "<id>"),
        rich.reason,
        rich.domain,
        tuple(sorted(rich.metadata.items())),
        rich.retry_after_s,
        tuple(rich.quota_violations),
        tuple(rich.field_violations),
    )


async def _refused(tenants: Tenants, service: str, method: str, request: Any) -> Any:
    try:
        await tenants.call("acme", service, method, request)
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError(f"served: {method} {request}")


async def test_a_tenant_reaches_none_of_anothers_sandboxes_and_learns_nothing(
    tenants: Tenants,
) -> None:
    await _world(tenants)
    before = await tenants.snapshot()
    assert {"globex--running", "legacy-running", "acme--planted-running"} <= before.running
    assert before.redis.keys, "the world's activations left admission state in Redis"

    answers: dict[str, set[tuple[Any, ...]]] = {}
    for name, (targets, build, names_globex) in SANDBOX_CALLS.items():
        for sandbox in targets:
            error = await _refused(tenants, *build(sandbox))
            answer = _answer(error, sandbox)
            answers.setdefault(name, set()).add(answer)
            assert answer[0] == grpc.StatusCode.PERMISSION_DENIED, (name, sandbox, answer)
            assert dict(answer[4])["identity"] == f"{TD}/client/acme"
            if not names_globex:
                assert "globex" not in repr(answer), (name, sandbox, answer)
    for name, seen in answers.items():
        assert len(seen) == 1, (name, seen)  # one answer, whatever the target is
    # The check under the claim answers as the authorizer does.
    (planted,) = answers["Activate client=acme"]
    assert planted[1] == f"identity may not act for sandbox <id>: /{SUBSTRATE}/Activate"

    for name, (service, method, request) in CLIENT_CALLS.items():
        error = await _refused(tenants, service, method, request)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, name

    after = await tenants.snapshot()
    assert after.changes_since(before) == {}

    # globex was locked out of nothing: it reads, restores and stops its own.
    for sandbox in ("globex--stopped", "legacy-stopped", "acme--planted-stopped"):
        got = await tenants.call(
            "globex", SUBSTRATE, "GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id=sandbox)
        )
        assert got.sandbox.activating_client_id == "globex"
        woken = await tenants.activate("globex", sandbox, INHERIT)
        assert woken.outcome == substrate_pb2.OUTCOME_RESTORED
        assert woken.charged_client_id == "globex"
    await tenants.deactivate("globex", "globex--running")
    owners = await rows(
        tenants.database_url, "SELECT id, activating_client_id FROM sandboxes ORDER BY id"
    )
    assert {r["id"]: r["activating_client_id"] for r in owners} == {
        "acme--mine": "acme",
        **{s: "globex" for s in TARGETS if "missing" not in s},
    }


async def test_a_tenant_creates_and_lists_only_in_its_own_namespace(tenants: Tenants) -> None:
    await _world(tenants)
    made = await tenants.activate("acme", "acme--new", client("acme"))
    assert made.outcome == substrate_pb2.OUTCOME_CREATED
    assert made.charged_client_id == "acme"
    again = await tenants.activate("acme", "acme--new", client("acme"))
    assert again.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
    listed = await tenants.call(
        "acme", SUBSTRATE, "ListSandboxes", substrate_pb2.ListSandboxesRequest(client_id="acme")
    )
    assert {s.sandbox_id for s in listed.sandboxes} == {"acme--mine", "acme--new"}
    assert {s.activating_client_id for s in listed.sandboxes} == {"acme"}
    # Outside its namespace nothing is created, so no id can be taken from globex first.
    for sandbox in ("globex--later", "later", "acmecorp--x"):
        await _refused(tenants, *_activate(client("acme"))(sandbox))
    # A client whose id starts like another's owns nothing of it: ``acme--corp--x`` is
    # in acme's namespace, so the identity client/acme--corp (if one existed) could not
    # create it, and acme can.
    corp = await tenants.activate("acme", "acme--corp--x", client("acme"))
    assert corp.charged_client_id == "acme"
    # The platform (``any``) is bound by no namespace and keeps today's charging.
    platform = await tenants.activate("ops", "anything", client("globex"))
    assert platform.charged_client_id == "globex"
    taken_over = await tenants.activate("ops", "globex--running", client("acme"))
    assert taken_over.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING


async def test_a_tenants_usage_shows_its_own_key_and_nothing_summed_over_tenants(
    tenants: Tenants,
) -> None:
    await _world(tenants)
    request = admission_pb2.GetUsageRequest(client=client("acme"))
    own = await tenants.call("acme", ADMISSION, "GetUsage", request)
    assert own.key.key == "acme"
    assert own.client_capacity > 0
    # The cluster bucket and the node slots count every tenant's activations.
    assert (own.cluster_tokens, own.cluster_capacity, dict(own.node_slots_held)) == (0, 0, {})
    platform = await tenants.call("ops", ADMISSION, "GetUsage", request)
    assert platform.cluster_capacity > 0


async def test_a_sandbox_re_recorded_after_the_authorizers_read_is_still_refused(
    tenants: Tenants,
) -> None:
    """The authorizer reads the owner, the handler reads the record: between the two an
    ``any`` caller may re-record the sandbox. Played here by an owner lookup that still
    answers the old owner (acme) for sandboxes now recorded to globex: the handlers'
    own check refuses them alike and nothing changes."""
    await _world(tenants)
    assert tenants.substrate.authorizer is not None

    async def stale(sandbox_id: str) -> str | None:
        return "acme"

    tenants.substrate.authorizer.set_owner_lookup(stale)
    before = await tenants.snapshot()
    answers = set()
    targets = ("globex--running", "globex--stopped", "legacy-running", "legacy-stopped")
    for sandbox in (*targets, "globex--missing"):
        for method, request in (
            ("GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id=sandbox)),
            ("Deactivate", substrate_pb2.DeactivateRequest(sandbox_id=sandbox)),
            ("Activate", substrate_pb2.ActivateRequest(sandbox_id=sandbox, client=INHERIT)),
            ("Activate", substrate_pb2.ActivateRequest(sandbox_id=sandbox, client=client("acme"))),
        ):
            error = await _refused(tenants, SUBSTRATE, method, request)
            answer = _answer(error, sandbox)
            assert answer[0] == grpc.StatusCode.PERMISSION_DENIED, (method, sandbox, answer)
            assert "globex" not in repr(answer)
            assert answer[1] == f"identity may not act for sandbox <id>: /{SUBSTRATE}/{method}"
            answers.add(answer)
    assert len(answers) == 3  # one per method, as the authorizer's own refusals
    after = await tenants.snapshot()
    assert after.changes_since(before) == {}


async def test_refusals_the_handlers_make_are_logged_throttled_like_the_authorizers(
    tenants: Tenants, caplog: pytest.LogCaptureFixture
) -> None:
    """An id in acme's namespace the platform recorded to globex: the authorizer lets
    acme's explicit Activate through (its namespace needs no lookup) and the handler
    refuses it. A tenant can repeat that at its call rate, so the handler's refusal
    lines are throttled per identity, method and reason as the authorizer's are
    (SPEC O6): one line a minute with a count of the rest, not one per call."""
    await tenants.activate("ops", "acme--theirs", client("globex"))
    request = substrate_pb2.ActivateRequest(sandbox_id="acme--theirs", client=client("acme"))
    caplog.set_level(logging.WARNING, logger="turnstile_platform.authz.authorizer")
    for _ in range(50):
        error = await _refused(tenants, SUBSTRATE, "Activate", request)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    lines = [r for r in caplog.records if r.getMessage().startswith("call refused")]
    assert len(lines) <= 1, len(lines)


async def test_a_refusal_echoes_a_bounded_part_of_an_oversized_id(
    tenants: Tenants, caplog: pytest.LogCaptureFixture
) -> None:
    """Authorization runs before validation, so a refusal echoes an id nobody checked
    the length of: a 200 KB one is cut, in the status and in the log line (a log line
    that long stalled the local stack's substrate once its log reader gave up)."""
    huge = "globex--" + "x" * 200_000
    caplog.set_level(logging.WARNING, logger="turnstile_platform.authz.authorizer")
    for method, request in (
        ("GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id=huge)),
        ("Deactivate", substrate_pb2.DeactivateRequest(sandbox_id=huge)),
        ("Activate", substrate_pb2.ActivateRequest(sandbox_id=huge, client=client("acme"))),
        ("Activate", substrate_pb2.ActivateRequest(sandbox_id="acme--a", client=client(huge))),
    ):
        error = await _refused(tenants, SUBSTRATE, method, request)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert len(error.details()) < 300, (method, len(error.details()))
        assert "... (200008 characters)" in error.details()
    for record in caplog.records:  # the lines the throttle let through
        assert len(str(record.__dict__.get("why", ""))) < 300
