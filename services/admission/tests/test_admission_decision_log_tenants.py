"""The decision log's per-tenant room (SPEC N3), through the real admission server
over mutual TLS with tenant certificates: one tenant's refused flood trims only its
own history; a tenant's read reads its own entries alone (counted by
``turnstile_admission_decision_log_entries_read_total``, so no timing is needed),
whatever another tenant logged, and its cursors never name another tenant's entry;
a cursor Redis would refuse is INVALID_ARGUMENT naming the field, with nothing
logged at ERROR."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import REGISTRY

from turnstile_admission.decision_log import MAX_SCANNED
from turnstile_clientkeys.limits import LimitsStore
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.errors import decode
from turnstile_testing.pki import Pki

SERVICE = "turnstile.admission.v1.AdmissionService"
TD = "spiffe://turnstile.test"
NODE = 100  # stream-node-max-entries: '~' trims whole nodes

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/operator/*"]
methods = ["{SERVICE}/*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = ["{SERVICE}/Admit", "{SERVICE}/ListDecisions"]
clients = "self"
"""

READ = "turnstile_admission_decision_log_entries_read_total"
STREAM_KINDS = ("key", "sandbox", "platform", "legacy")


def entries_read() -> float:
    """Entries ListDecisions has read from Redis so far, over every kind of stream."""
    return sum(REGISTRY.get_sample_value(READ, {"stream": k}) or 0.0 for k in STREAM_KINDS)


def admit(client_id: str, sandbox_id: str) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
    )


def listing(client_id: str, **fields: Any) -> admission_pb2.ListDecisionsRequest:
    return admission_pb2.ListDecisionsRequest(client_id=client_id, **fields)


class Tenants:
    """acme's and globex's stubs, each over its own certificate, and an operator's."""

    def __init__(self, stubs: dict[str, Any], settings: Any) -> None:
        self.stubs = stubs
        self.settings = settings

    def __getitem__(self, who: str) -> Any:
        return self.stubs[who]

    async def admits(self, who: str, sandbox_ids: list[str], concurrency: int = 100) -> None:
        """``who``'s own Admit calls, ``concurrency`` at a time."""
        stub = self.stubs[who]
        for at in range(0, len(sandbox_ids), concurrency):
            chunk = sandbox_ids[at : at + concurrency]
            await asyncio.gather(*(stub.Admit(admit(who, s)) for s in chunk))


@pytest.fixture
async def start_tenants(start_admission: Any, pki: Pki) -> AsyncIterator[Any]:
    channels: list[grpc.aio.Channel] = []

    async def start(**overrides: Any) -> Tenants:
        running = await start_admission(
            client_allowlist=("acme", "globex"),
            rate={"default_burst": 100_000, "cluster_burst": 100_000},
            **pki.server_settings("service/admission", policy=POLICY),
            **overrides,
        )
        stubs = {}
        for who, identity in (
            ("acme", "client/acme"),
            ("globex", "client/globex"),
            ("ops", "operator/ops"),
        ):
            channel = pki.identity(identity).channel(running.app.address)
            channels.append(channel)
            stubs[who] = admission_pb2_grpc.AdmissionServiceStub(channel)
        return Tenants(stubs, running.settings)

    yield start
    for channel in channels:
        await channel.close(None)


async def test_a_refused_flood_by_one_tenant_leaves_anothers_entries_in_place(
    start_tenants: Any, redis: Any
) -> None:
    tenants = await start_tenants(decision_log={"max_entries": 100})
    await tenants.admits("globex", ["globex--a", "globex--b", "globex--c"])
    # acme at its concurrency limit: every Admit it sends is refused and logged.
    await LimitsStore(redis, tenants.settings.redis_prefix).put("key:acme", {"concurrency": 0})
    await tenants.admits("acme", [f"acme--{n}" for n in range(400)])
    own = await tenants["acme"].ListDecisions(listing("acme", limit=500))
    assert 100 <= len(own.decisions) < 100 + NODE  # acme's history, trimmed to its bound
    assert {d.kind for d in own.decisions} == {"refused"}
    globex = await tenants["globex"].ListDecisions(listing("globex"))
    assert sorted(d.sandbox_id for d in globex.decisions) == ["globex--a", "globex--b", "globex--c"]
    # `turnstilectl why globex--a` (an operator's read of one sandbox) still has it.
    why = await tenants["ops"].ListDecisions(listing("", sandbox_id="globex--a"))
    assert [d.kind for d in why.decisions] == ["admitted"]


async def test_a_window_read_reads_none_of_another_tenants_entries_nor_names_one(
    start_tenants: Any,
) -> None:
    tenants = await start_tenants()
    await tenants.admits("acme", ["acme--a", "acme--b", "acme--c"])
    # The window starts after acme's newest entry (its id's ms, on Redis's clock).
    newest = (await tenants["acme"].ListDecisions(listing("acme", limit=1))).decisions[0]
    window = Timestamp()
    window.FromMilliseconds(int(newest.id.split("-")[0]) + 1)
    # More of globex's entries in the window than one read may scan: the single
    # stream's read stopped at its scan bound with a cursor naming one of them.
    flood = [f"globex--{n}" for n in range(MAX_SCANNED + 1)]
    await tenants.admits("globex", flood, concurrency=200)
    globex_ids = set()
    before: str = ""
    while True:
        page = await tenants["ops"].ListDecisions(listing("globex", limit=500, before=before))
        globex_ids |= {d.id for d in page.decisions}
        if not page.next_before:
            break
        before = page.next_before
    assert len(globex_ids) == len(flood)

    read = entries_read()
    quiet = await tenants["acme"].ListDecisions(listing("acme", since=window))
    assert (list(quiet.decisions), quiet.next_before) == ([], "")
    assert entries_read() - read == 0  # not one of globex's entries was read
    # A paged read of acme's own: each cursor is the id of an entry of acme's.
    seen: list[str] = []
    before = ""
    while True:
        read = entries_read()
        page = await tenants["acme"].ListDecisions(listing("acme", limit=2, before=before))
        assert entries_read() - read <= 2
        seen += [d.id for d in page.decisions]
        if not page.next_before:
            break
        assert page.next_before in seen
        assert page.next_before not in globex_ids
        before = page.next_before
    assert len(seen) == 3


async def test_a_sandbox_filtered_read_reads_only_that_sandboxs_entries(
    start_tenants: Any,
) -> None:
    tenants = await start_tenants()
    await tenants.admits("acme", [f"acme--{s}" for s in ("a", "b") for _ in range(10)])
    await tenants.admits("globex", [f"globex--{n}" for n in range(50)])
    read = entries_read()
    one = await tenants["acme"].ListDecisions(listing("acme", sandbox_id="acme--a"))
    assert [d.sandbox_id for d in one.decisions] == ["acme--a"] * 10
    assert entries_read() - read == 10  # its entries alone: not acme--b's, not globex's
    read = entries_read()
    none = await tenants["acme"].ListDecisions(listing("acme", sandbox_id="acme--nothing"))
    assert (list(none.decisions), none.next_before) == ([], "")
    assert entries_read() - read == 0


@pytest.mark.parametrize(
    ("field", "cursor"),
    [
        ("before", "0-0"),  # nothing is older: Redis refuses the range
        ("after", "18446744073709551615-18446744073709551615"),  # nothing is newer
        ("before", "18446744073709551616-0"),  # past 64 bits
        ("after", "1-99999999999999999999"),
        ("before", "yesterday"),
    ],
)
async def test_a_bad_cursor_is_invalid_argument_naming_the_field_with_no_error_logged(
    start_tenants: Any, caplog: pytest.LogCaptureFixture, field: str, cursor: str
) -> None:
    tenants = await start_tenants()
    await tenants.admits("acme", ["acme--a"])
    caplog.set_level(logging.INFO)
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await tenants["acme"].ListDecisions(listing("acme", **{field: cursor}))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [v.field for v in decode(bad.value).field_violations] == [field]
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
