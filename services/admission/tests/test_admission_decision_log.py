"""The decision log (SPEC Q3) through the real Admit path against real Redis: every
decision shape is logged exactly once with its fields, in the script that decides;
a decision that did not happen (a settled hold's late script, a dry run) is not;
the log keeps its bounds under a 300-way burst; ListDecisions reads it in bounded
pages, filtered by client, sandbox and time."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from prometheus_client import REGISTRY
from redis.exceptions import ResponseError

from turnstile_admission.decision_log import (
    CursorRejectedError,
    Query,
    Source,
    parse_entry,
    read,
)
from turnstile_admission.policies import PolicyName
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs, LogContext
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys.limits import LimitsStore
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform.decision_log import append_platform_entry, key_stream, streams_index
from turnstile_platform.settings import DecisionLogSettings

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
#: Redis's stream-node-max-entries default: '~' trims whole nodes only.
NODE = 100


def cold(sandbox_id: str, client_id: str = "acme", **extra: Any) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        **extra,
    )


def traced(sampled: bool) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{TRACE}-00f067aa0ba902b7-{'01' if sampled else '00'}"),)


async def entries(redis: Any, stream: str) -> list[dict[str, str]]:
    return [
        {k.decode(): v.decode() for k, v in fields.items()}
        for _, fields in await redis.xrange(stream)
    ]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_admitted_and_refused_are_logged_once_with_their_fields(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(
        client_allowlist=("acme",),
        concurrency={"default_limit": 1},
        tracer_provider=TracerProvider(sampler=ParentBased(ALWAYS_OFF)),
    )
    stream = running.keys.decision_stream("acme")
    admitted = await running.stub.Admit(cold("sb-1"), metadata=traced(sampled=False))
    refused = await running.stub.Admit(cold("sb-2"), metadata=traced(sampled=True))
    assert (admitted.decision, refused.decision) == (ADMITTED, REFUSED)
    first, second = await entries(redis, stream)
    assert first["kind"] == "admitted"
    # The trace id whether or not the trace was sampled.
    assert (first["trace"], first["sampled"]) == (TRACE, "0")
    assert (first["client"], first["sandbox"], first["key"], first["key_kind"]) == (
        "acme",
        "sb-1",
        "acme",
        "own",
    )
    assert first["key_set"] == str(admitted.key.key_set_version)
    assert first["activation"] == "cold_create"
    assert (first["hold"], int(first["hold_exp"])) == (
        admitted.hold_id,
        admitted.hold_expires_at.ToMilliseconds(),
    )
    assert first["identity"] == ""  # plaintext: no caller identity
    verdicts = {v["p"]: v for v in json.loads(first["verdicts"])}
    assert verdicts["concurrency"]["v"] == "pass"
    assert (verdicts["concurrency"]["l"], verdicts["concurrency"]["c"]) == (1, 0)
    assert "node_slots" not in verdicts  # not evaluated (no candidate nodes): left out
    assert second["kind"] == "refused"
    assert (second["trace"], second["sampled"]) == (TRACE, "1")
    assert second["hold"] == ""
    refusing = {v["p"]: v for v in json.loads(second["verdicts"])}["concurrency"]
    assert (refusing["v"], refusing["l"], refusing["c"]) == ("over", 1, 1)
    typed = parse_entry("1-0", {k.encode(): v.encode() for k, v in second.items()})
    assert typed.refused_by is not None
    assert typed.refused_by.policy is PolicyName.CONCURRENCY


async def test_shadow_mode_and_unknown_verdicts_are_logged_as_such(
    start_admission: Any, redis: aioredis.Redis, live: Any
) -> None:
    running = await start_admission(
        client_allowlist=("acme",), concurrency={"mode": "shadow", "default_limit": 1}
    )
    first = await running.stub.Admit(cold("sb-1"))
    shadowed = await running.stub.Admit(cold("sb-2"))
    assert shadowed.decision == ADMITTED
    for hold in (first.hold_id, shadowed.hold_id):  # the leases go: concurrency passes
        await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=hold))
    await live.unsupported()  # the cap cannot decide: it admits with UNKNOWN
    unknown = await running.stub.Admit(cold("sb-3"))
    assert unknown.decision == ADMITTED
    logged = await entries(redis, running.keys.decision_stream("acme"))
    assert [e["kind"] for e in logged] == ["admitted", "shadow_refused", "admitted"]
    cap = {v["p"]: v for v in json.loads(logged[2]["verdicts"])}["cap"]
    assert cap["v"] == "unknown"  # the verdict says what the kind does not


async def test_shadow_limits_are_reported_counted_and_never_refuse(
    start_admission: Any, redis: aioredis.Redis, redis_prefix: str
) -> None:
    running = await start_admission(client_allowlist=("acme",))
    await LimitsStore(redis, redis_prefix).put(
        "key:acme", {"cap": 10, "concurrency": 10, "shadow": {"cap": 2, "concurrency": 1}}
    )
    labels = {"key": "acme"}
    cap_before = sample("turnstile_admission_shadow_refusals_total", policy="cap", **labels)
    conc_before = sample(
        "turnstile_admission_shadow_refusals_total", policy="concurrency", **labels
    )
    answers = [await running.stub.Admit(cold(f"sb-{i}")) for i in range(4)]
    assert [a.decision for a in answers] == [ADMITTED] * 4  # never refusing
    shadow = [
        {s.policy: (s.verdict, s.limit, s.current) for s in a.shadow_verdicts} for a in answers
    ]
    over, ok = admission_pb2.VERDICT_SHADOW_REFUSE, admission_pb2.VERDICT_PASS
    assert [s[admission_pb2.POLICY_CAP] for s in shadow] == [
        (ok, 2, 0),
        (ok, 2, 1),
        (over, 2, 2),
        (over, 2, 3),
    ]
    assert [s[admission_pb2.POLICY_CONCURRENCY][0] for s in shadow] == [ok, over, over, over]
    assert admission_pb2.POLICY_RATE not in shadow[0]  # no shadow rate limit set
    # Counted exactly: one per decision that reached the shadow limit.
    cap_after = sample("turnstile_admission_shadow_refusals_total", policy="cap", **labels)
    conc_after = sample("turnstile_admission_shadow_refusals_total", policy="concurrency", **labels)
    assert (cap_after - cap_before, conc_after - conc_before) == (2, 3)
    logged = await entries(redis, running.keys.decision_stream("acme"))
    assert [e["kind"] for e in logged] == ["admitted"] + ["shadow_refused"] * 3
    cap = {v["p"]: v for v in json.loads(logged[2]["verdicts"])}["cap"]
    assert cap["s"] == {"v": "over", "l": 2, "c": 2}


async def test_a_shadow_rate_limit_has_its_own_bucket(
    start_admission: Any, redis: aioredis.Redis, redis_prefix: str
) -> None:
    running = await start_admission(client_allowlist=("acme",))
    await LimitsStore(redis, redis_prefix).put(
        "key:acme", {"rate": 1, "burst": 10, "shadow": {"burst": 2}}
    )
    answers = [await running.stub.Admit(cold(f"sb-{i}")) for i in range(4)]
    assert [a.decision for a in answers] == [ADMITTED] * 4
    rate = [
        next(s for s in a.shadow_verdicts if s.policy == admission_pb2.POLICY_RATE) for a in answers
    ]
    assert [r.verdict == admission_pb2.VERDICT_SHADOW_REFUSE for r in rate] == [
        False,
        False,
        True,
        True,
    ]
    assert [r.limit for r in rate] == [2] * 4


async def test_a_settled_holds_late_script_and_a_dry_run_log_nothing(
    redis: aioredis.Redis, redis_prefix: str, live: Any
) -> None:
    store = AdmissionStore(redis, AdmissionSettings(redis_prefix=redis_prefix))
    modes = {PolicyName.CAP: 2, PolicyName.RATE: 2, PolicyName.CONCURRENCY: 2, PolicyName.SLOTS: 0}
    await store.cancel("late")  # settled first: its tombstone
    late = await store.admit(AdmitArgs("late", "acme", "sb-1", modes, log=LogContext()))
    assert late.outcome == "cancelled"
    dry = await store.admit(AdmitArgs("dry", "acme", "sb-1", modes, dry_run=True))
    assert dry.outcome == "admit"
    assert await redis.xlen(store.keys.decision_stream("acme")) == 0
    done = await store.admit(AdmitArgs("real", "acme", "sb-1", modes, log=LogContext()))
    assert done.outcome == "admit"
    assert await redis.xlen(store.keys.decision_stream("acme")) == 1


async def test_the_log_keeps_its_bounds_under_a_300_way_burst(
    start_admission: Any, redis: Any
) -> None:
    running = await start_admission(
        client_allowlist=("acme",),
        cap={"default_cap": 1000},
        concurrency={"default_limit": 1000},
        rate={"default_burst": 200, "default_rate_per_s": 1},
        decision_log={"max_entries": 120, "max_age_s": 600},
    )
    answers = await asyncio.gather(*(running.stub.Admit(cold(f"sb-{i}")) for i in range(300)))
    admitted = sum(a.decision == ADMITTED for a in answers)
    assert 0 < admitted < 300  # both shapes in the burst (the bucket holds 200)
    stream = running.keys.decision_stream("acme")
    assert 120 <= await redis.xlen(stream) < 120 + NODE
    # It expires max age after its last entry, at most one trim period (1 s) later.
    assert 600_000 < await redis.pttl(stream) <= 601_000
    # Exactly once: the newest entries are the last decisions, one each.
    newest = await redis.xrevrange(stream, count=120)
    sandboxes = [fields[b"sandbox"] for _, fields in newest]
    assert len(set(sandboxes)) == len(sandboxes)


async def test_every_decision_of_a_burst_is_logged_exactly_once(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(
        client_allowlist=("acme",),
        cap={"default_cap": 1000},
        concurrency={"default_limit": 1000},
        rate={"default_burst": 200, "default_rate_per_s": 1},
    )
    answers = await asyncio.gather(*(running.stub.Admit(cold(f"sb-{i}")) for i in range(300)))
    logged = await entries(redis, running.keys.decision_stream("acme"))
    assert sorted(e["sandbox"] for e in logged) == sorted(f"sb-{i}" for i in range(300))
    holds = {e["hold"] for e in logged if e["kind"] == "admitted"}
    assert holds == {a.hold_id for a in answers if a.decision == ADMITTED}


async def test_list_decisions_filters_and_pages(start_admission: Any) -> None:
    running = await start_admission(client_allowlist=("acme", "globex"))
    for i in range(5):
        await running.stub.Admit(cold(f"sb-{i}"))
        await running.stub.Admit(cold(f"gx-{i}", "globex"))
    stub = running.stub
    every = await stub.ListDecisions(admission_pb2.ListDecisionsRequest())
    assert len(every.decisions) == 10
    assert every.decisions[0].sandbox_id == "gx-4"  # newest first
    acme = await stub.ListDecisions(admission_pb2.ListDecisionsRequest(client_id="acme", limit=2))
    assert [d.sandbox_id for d in acme.decisions] == ["sb-4", "sb-3"]
    assert all(d.client == "acme" and d.service == "admission" for d in acme.decisions)
    assert acme.decisions[0].key.key == "acme"
    assert acme.decisions[0].activation_kind == common_pb2.ACTIVATION_KIND_COLD_CREATE
    assert acme.decisions[0].verdicts[0].policy == admission_pb2.POLICY_CONCURRENCY
    more = await stub.ListDecisions(
        admission_pb2.ListDecisionsRequest(client_id="acme", before=acme.next_before)
    )
    assert [d.sandbox_id for d in more.decisions] == ["sb-2", "sb-1", "sb-0"]
    assert more.next_before == ""
    one = await stub.ListDecisions(admission_pb2.ListDecisionsRequest(sandbox_id="gx-2"))
    assert [d.sandbox_id for d in one.decisions] == ["gx-2"]
    newer = await stub.ListDecisions(
        admission_pb2.ListDecisionsRequest(after=one.decisions[0].id, client_id="globex")
    )
    assert [d.sandbox_id for d in newer.decisions] == ["gx-4", "gx-3"]
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await stub.ListDecisions(admission_pb2.ListDecisionsRequest(before="yesterday"))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class Shipper:
    """The export docs/operations.md documents (SPEC N3): a consumer group on each
    stream the log's index lists, created at ``0`` when the stream is first seen
    (so what it held before is shipped too), all read in one XREADGROUP, each entry
    acknowledged on its own stream once stored; after a restart, ``0`` first."""

    def __init__(self, redis: Any, prefix: str) -> None:
        self.redis = redis
        self.index = streams_index(prefix)
        self.streams: list[bytes] = []
        self.stored: list[tuple[bytes, bytes]] = []

    async def discover(self) -> None:
        for stream in await self.redis.zrange(self.index, 0, -1):
            if stream in self.streams:
                continue
            try:
                await self.redis.xgroup_create(stream, "shipper", id="0")
            except ResponseError as error:
                if "BUSYGROUP" not in str(error):  # a group already there is fine
                    raise
            self.streams.append(stream)

    async def read(self, start: str, count: int, ack: bool = True) -> list[tuple[bytes, bytes]]:
        got = await self.redis.xreadgroup(
            "shipper", "s1", dict.fromkeys(self.streams, start), count=count
        )
        delivered = [(stream, entry_id) for stream, items in got for entry_id, _ in items]
        if ack:
            for stream, entry_id in delivered:
                self.stored.append((stream, entry_id))
                await self.redis.xack(stream, "shipper", entry_id)
        return delivered


async def every_entry(redis: Any, prefix: str) -> list[tuple[bytes, bytes]]:
    """Every entry of every stream the index lists (sandbox streams are copies)."""
    out = []
    for stream in await redis.zrange(streams_index(prefix), 0, -1):
        out += [(stream, entry_id) for entry_id, _ in await redis.xrange(stream)]
    return out


async def test_consumer_groups_on_the_indexed_streams_ship_every_entry_once(
    start_admission: Any, redis: Any
) -> None:
    running = await start_admission(client_allowlist=("acme", "globex", "initech"))
    prefix = running.settings.redis_prefix
    for sandbox, client_id in [("sb-1", "acme"), ("sb-2", "acme"), ("gx-1", "globex")]:
        await running.stub.Admit(cold(sandbox, client_id))
    await running.stub.Admit(cold("x-1", "someone"))  # the shared key's stream
    await append_platform_entry(
        redis, prefix, DecisionLogSettings(), service="admission", kind="limits_changed"
    )
    shipper = Shipper(redis, prefix)
    await shipper.discover()
    assert len(shipper.streams) == 4  # acme, globex, shared, platform
    assert len(await shipper.read(">", count=1)) == 4  # one from each
    # Delivered, not acknowledged: the shipper stops before storing them.
    unacked = await shipper.read(">", count=1, ack=False)
    assert len(unacked) == 1  # acme's second
    # More entries meanwhile, one of them in a stream the shipper has not seen.
    await running.stub.Admit(cold("sb-3", "acme"))
    await running.stub.Admit(cold("in-1", "initech"))
    # A restart: what was delivered and not acknowledged first, then what is new.
    assert await shipper.read("0", count=100) == unacked
    await shipper.discover()
    while await shipper.read(">", count=100):
        pass
    logged = await every_entry(redis, prefix)
    assert len(logged) == 7
    assert sorted(shipper.stored) == sorted(logged)  # every entry, each once


def test_a_wait_of_zero_ms_is_a_wait_and_no_wait_field_is_none() -> None:
    # A waiter granted within the millisecond waited; a call that never queued did not.
    assert parse_entry("1-0", {b"kind": b"admitted", b"wait": b"0"}).waited_ms == 0
    assert parse_entry("1-0", {b"kind": b"admitted"}).waited_ms is None


async def test_an_operator_reads_every_stream_merged_newest_first_across_pages(
    start_admission: Any, redis: Any
) -> None:
    running = await start_admission(client_allowlist=("acme", "globex"))
    prefix = running.settings.redis_prefix
    for n in range(4):
        await running.stub.Admit(cold(f"sb-{n}"))
        await running.stub.Admit(cold(f"gx-{n}", "globex"))
    await running.stub.Admit(cold("x-1", "someone"))  # the shared key
    await append_platform_entry(
        redis, prefix, DecisionLogSettings(), service="admission", kind="keys_changed"
    )
    seen: list[Any] = []
    before = ""
    while True:
        page = await running.stub.ListDecisions(
            admission_pb2.ListDecisionsRequest(limit=3, before=before)
        )
        seen += page.decisions
        if not page.next_before:
            break
        before = page.next_before
    assert len(seen) == 10
    order = [tuple(int(p) for p in d.id.split("-")) for d in seen]
    assert order == sorted(order, reverse=True)  # newest first, none twice
    assert seen[0].kind == "keys_changed"
    # A client of the shared key reads its own entries only (filtered by client).
    other = await running.stub.ListDecisions(admission_pb2.ListDecisionsRequest(client_id="x"))
    assert list(other.decisions) == []
    someone = await running.stub.ListDecisions(
        admission_pb2.ListDecisionsRequest(client_id="someone")
    )
    assert [d.sandbox_id for d in someone.decisions] == ["x-1"]


async def test_the_single_stream_before_n3_is_read_while_it_lasts(
    start_admission: Any, redis: Any
) -> None:
    """An upgrade: entries the old admission wrote to ``<prefix>{adm}:decisions`` are
    read beside the new streams (filtered as they were) until turned off."""
    running = await start_admission(client_allowlist=("acme",))
    legacy = running.keys.decisions
    old = {"at": "1", "service": "admission", "kind": "refused", "client": "acme"}
    await redis.xadd(legacy, {**old, "sandbox": "sb-old"}, id="1-1")
    await redis.xadd(legacy, {**old, "sandbox": "gx-old", "client": "globex"}, id="1-2")
    await running.stub.Admit(cold("sb-new"))
    acme = await running.stub.ListDecisions(admission_pb2.ListDecisionsRequest(client_id="acme"))
    assert [d.sandbox_id for d in acme.decisions] == ["sb-new", "sb-old"]
    one = await running.stub.ListDecisions(
        admission_pb2.ListDecisionsRequest(client_id="acme", sandbox_id="sb-old")
    )
    assert [d.id for d in one.decisions] == ["1-1"]
    every = await running.stub.ListDecisions(admission_pb2.ListDecisionsRequest())
    assert [d.sandbox_id for d in every.decisions] == ["sb-new", "gx-old", "sb-old"]
    after = await start_admission(client_allowlist=("acme",), decision_log={"read_legacy": False})
    acme = await after.stub.ListDecisions(admission_pb2.ListDecisionsRequest(client_id="acme"))
    assert [d.sandbox_id for d in acme.decisions] == ["sb-new"]


async def test_a_cursor_redis_refuses_is_reported_for_its_field(
    redis: Any, redis_prefix: str
) -> None:
    """The backstop behind the validation: Redis's refusal of a range names the
    cursor the query carried, for the handler to answer INVALID_ARGUMENT."""
    stream = key_stream(redis_prefix, "acme")
    await redis.xadd(stream, {"kind": "admitted"})
    with pytest.raises(CursorRejectedError) as rejected:
        await read(redis, [Source(stream, "key")], Query(before="0-0"))
    assert rejected.value.field == "before"
    with pytest.raises(CursorRejectedError) as rejected:
        await read(redis, [Source(stream, "key")], Query(after="99999999999999999999-0"))
    assert rejected.value.field == "after"
