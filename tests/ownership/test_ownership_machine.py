"""Random interleavings of two tenants' calls never change what the other owns (SPEC O1).

A hypothesis state machine drives ``acme`` and ``globex`` through the real services
(mTLS, Redis, PostgreSQL, Direct runtimes): each step one tenant calls one RPC that
names a sandbox or a client, on an id of its own namespace, the other's, or an old id
of no namespace recorded to one of them. After every step:

* the other tenant's state is byte for byte what it was: its PostgreSQL rows
  (sandboxes recorded to it or in its namespace, their executions, receipts and
  claims), its runtimes, and every Redis key whose name carries its client id;
* no answer carries the other tenant's record (a client id, a runtime name);
* every namespaced sandbox is recorded to its namespace's client (nobody squats).

The machine runs in a worker thread; each call goes to the services on the test's
event loop. State carries over between examples: each step checks only what it
changed, so no reset is needed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.authz.ownership import namespace_of
from turnstile_testing.authz import RedisState, redis_state

from .conftest import ADMISSION, INHERIT, SUBSTRATE, Tenants, client, rows, runtime_ids

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")
TENANTS = ("acme", "globex")
IDS = (
    "acme--a",
    "acme--b",
    "globex--a",
    "globex--b",
    "legacy-acme",
    "legacy-globex",
)
ACTIONS = (
    "activate-self",
    "activate-other",
    "activate-inherit",
    "deactivate",
    "get",
    "list-self",
    "list-other",
    "admit-self",
    "release",
    "usage-other",
)

#: Actions whose request names the other tenant (its refusal may echo the name).
NAME_THE_OTHER = frozenset({"activate-other", "list-other", "usage-other"})
#: Actions that name no sandbox.
TARGETLESS = frozenset({"list-self", "list-other", "usage-other"})


def _other(tenant: str) -> str:
    return "globex" if tenant == "acme" else "acme"


async def settled() -> None:
    """Wait for admission's background cancels of holds no caller settles (a refused
    Admit's hold: its tokens come back after the answer), so a step's snapshot does
    not catch the owner's own earlier call settling."""
    pending = [t for t in asyncio.all_tasks() if t.get_name().startswith("orphaned-hold-")]
    if pending:
        await asyncio.wait(pending)


@dataclass(frozen=True)
class Owned:
    """What one tenant owns: its PostgreSQL rows (sandboxes recorded to it or in its
    namespace, and their executions, receipts and claims), its runtimes, and every
    Redis key whose name carries its client id."""

    rows: tuple[object, ...]
    running: frozenset[str]
    redis: RedisState

    def changes_since(self, before: Owned) -> dict[str, object]:
        changes: dict[str, object] = {}
        if self.rows != before.rows:
            changes["postgres"] = (before.rows, self.rows)
        if self.running != before.running:
            changes["running"] = self.running ^ before.running
        if redis := self.redis.changes_since(before.redis):
            changes["redis"] = redis
        return changes


async def owned_state(tenants: Tenants, owner: str) -> Owned:
    """Everything ``owner`` owns (see :class:`Owned`)."""
    await settled()
    mine = await rows(
        tenants.database_url,
        "SELECT * FROM sandboxes WHERE activating_client_id = $1 OR id LIKE $2 ORDER BY id",
        owner,
        f"{owner}--%",
    )
    ids = [r["id"] for r in mine] + [f"legacy-{owner}"]
    related: list[object] = [tuple(r.values()) for r in mine]
    for table in ("executions", "receipts", "activation_claims"):
        found = await rows(
            tenants.database_url,
            f"SELECT * FROM {table} WHERE sandbox_id = ANY($1::text[])",  # noqa: S608 - fixed names
            ids,
        )
        related.append(sorted((tuple(r.values()) for r in found), key=repr))
    state = await redis_state(tenants.redis, tenants.redis_prefix)
    keys = {k: v for k, v in state.keys.items() if owner.encode() in k}
    return Owned(
        tuple(related),
        frozenset(runtime_ids(tenants.state_dir) & set(ids)),
        RedisState(keys, state.now_ms),
    )


def _request(actor: str, action: str, target: str) -> tuple[str, str, Any]:
    other = _other(actor)
    activate = substrate_pb2.ActivateRequest
    match action:
        case "activate-self":
            return SUBSTRATE, "Activate", activate(sandbox_id=target, client=client(actor))
        case "activate-other":
            return SUBSTRATE, "Activate", activate(sandbox_id=target, client=client(other))
        case "activate-inherit":
            return SUBSTRATE, "Activate", activate(sandbox_id=target, client=INHERIT)
        case "deactivate":
            return SUBSTRATE, "Deactivate", substrate_pb2.DeactivateRequest(sandbox_id=target)
        case "get":
            return SUBSTRATE, "GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id=target)
        case "list-self":
            return SUBSTRATE, "ListSandboxes", substrate_pb2.ListSandboxesRequest(client_id=actor)
        case "list-other":
            return SUBSTRATE, "ListSandboxes", substrate_pb2.ListSandboxesRequest(client_id=other)
        case "admit-self":
            request = admission_pb2.AdmitRequest(
                sandbox_id=target,
                client=client(actor),
                kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
            )
            return ADMISSION, "Admit", request
        case "release":
            release = admission_pb2.ReleaseSandboxRequest(sandbox_id=target)
            return ADMISSION, "ReleaseSandbox", release
        case _:
            return ADMISSION, "GetUsage", admission_pb2.GetUsageRequest(client=client(other))


def _clients_in(response: Any) -> set[str]:
    """Every client id a response names."""
    if isinstance(response, substrate_pb2.ActivateResponse):
        return {response.sandbox.activating_client_id, response.charged_client_id} - {""}
    if isinstance(response, substrate_pb2.GetSandboxResponse):
        return {response.sandbox.activating_client_id} - {""}
    if isinstance(response, substrate_pb2.ListSandboxesResponse):
        return {s.activating_client_id for s in response.sandboxes}
    return set()


async def _answer(
    tenants: Tenants, actor: str, action: str, sandbox: str
) -> tuple[Any, tuple[grpc.StatusCode, str] | None]:
    """(response, None) when served, (None, (code, details)) when refused."""
    try:
        return await tenants.call(actor, *_request(actor, action, sandbox)), None
    except grpc.aio.AioRpcError as error:
        return None, (error.code(), error.details() or "")


class TwoTenants(RuleBasedStateMachine):
    tenants: ClassVar[Tenants]
    loop: ClassVar[asyncio.AbstractEventLoop]

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=60)

    @rule(
        actor=st.sampled_from(TENANTS),
        action=st.sampled_from(ACTIONS),
        sandbox=st.sampled_from(IDS),
    )
    def call(self, actor: str, action: str, sandbox: str) -> None:
        other = _other(actor)
        before = self.run(owned_state(self.tenants, other))
        response, refused = self.run(_answer(self.tenants, actor, action, sandbox))
        if refused is not None:
            code, details = refused
            assert code == grpc.StatusCode.PERMISSION_DENIED, (action, sandbox, details)
            if action not in NAME_THE_OTHER:
                assert other not in details.replace(sandbox, ""), details
        else:
            assert other not in _clients_in(response), (action, sandbox, response)
            if action not in TARGETLESS:
                assert sandbox != f"legacy-{other}"
                assert namespace_of(sandbox) != other
        after = self.run(owned_state(self.tenants, other))
        assert after.changes_since(before) == {}, (actor, action, sandbox)

    @invariant()
    def namespaced_sandboxes_belong_to_their_namespace(self) -> None:
        records = self.run(
            rows(self.tenants.database_url, "SELECT id, activating_client_id FROM sandboxes")
        )
        for record in records:
            namespace = namespace_of(record["id"])
            if namespace is not None:
                assert record["activating_client_id"] == namespace, dict(record)


async def test_two_tenants_never_change_what_the_other_owns(tenants: Tenants) -> None:
    # Old ids of no namespace, made by the platform for each tenant (one stopped).
    await tenants.activate("ops", "legacy-acme", client("acme"))
    await tenants.activate("ops", "legacy-globex", client("globex"))
    await tenants.deactivate("ops", "legacy-globex")
    machine = type(
        "Machine", (TwoTenants,), {"tenants": tenants, "loop": asyncio.get_running_loop()}
    )
    await asyncio.to_thread(
        run_state_machine_as_test,
        machine,
        settings=settings(
            max_examples=6,
            stateful_step_count=15,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
