"""Every Lua script runs on a real Redis Cluster and declares the keys it touches
(SPEC F2), checked on what the servers ran rather than on review.

Each script runs through its real caller (the admission, affinity, live-count and
credential stores) against a 3-master cluster, while ``MONITOR`` on every master
records each script's declared ``KEYS`` and every command it ran
(:mod:`turnstile_testing.script_keys`). Two properties follow:

* the cluster ran them all: no key of another slot (the ``#!lua`` first line makes
  Redis refuse one) and no key on another node;
* every key a script touched is declared, except the few whose names a script
  learns by reading (a hold's bounded key, the sandbox a session's record names):
  those are listed per script below, and must carry the declared keys' hash tag.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ResponseError

from turnstile_admission.policies import CapSettings, PolicyName
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs, OwnLimits
from turnstile_admission.redis_store import script_text as admission_script
from turnstile_admission.settings import AdmissionSettings
from turnstile_affinity.store import SCRIPTS as AFFINITY_SCRIPTS
from turnstile_affinity.store import AffinityStore, Leased, MustMove, NoRecord, Pending, Turn
from turnstile_affinity.store import script_text as affinity_script
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_clientkeys.live_store import Change, LiveStore, Op
from turnstile_clientkeys.live_store import script_text as live_publish_script
from turnstile_platform.decision_log import DecisionLogWriter
from turnstile_platform.decision_log import script_text as decision_log_script
from turnstile_platform.redis_client import read_script
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    SigningKey,
    generate_key_pair,
)
from turnstile_platform.settings import DecisionLogSettings, ServiceSettings
from turnstile_testing.redis_cluster import RedisClusterServers
from turnstile_testing.script_keys import ScriptKeyRecorder, group_runs, parse_line

REPO = Path(__file__).resolve().parents[2]
ADMISSION = (
    "admit",
    "commit_hold",
    "cancel_hold",
    "release_sandbox",
    "usage",
    # The fair queue's (SPEC Q1): claim.lua is admit.lua wrapped, after its own part.
    "enqueue",
    "tick",
    "claim",
    "leave",
    # The warm-pool refill's reservation (SPEC W3).
    "reserve_warm",
    "fairness",
    "peek",
    # A waiting call's position, polled by its caller (SPEC Q1).
    "queue_position",
)
PLATFORM = ("sandbox_credential_renew", "sandbox_credential_revoke", "decision_append")
#: Prepended to other scripts, never run alone.
PRELUDES = {
    "_common",
    "_test_clock",
    "_lib",
    "_decision_log",
    "_decision_stream",
    "_queue",
    "_own_queue",
    "_grant_freed",
}

#: Every script's full text, by the name the report uses.
SCRIPTS: dict[str, str] = {
    **{f"admission/{n}": admission_script(f"{n}.lua") for n in ADMISSION},
    **{f"affinity/{n}": affinity_script(n) for n in AFFINITY_SCRIPTS},
    "clientkeys/live_publish": live_publish_script(),
    **{f"platform/{n}": read_script("turnstile_platform", f"{n}.lua") for n in PLATFORM},
    # Run with the shared append prepended (turnstile_platform.decision_log).
    "platform/decision_append": decision_log_script("decision_append.lua"),
}

#: The kinds of key (the name after the hash tag, to its first ':') each script may
#: touch without declaring, because it learns them by reading. Affinity's scripts
#: prune expired leases and presence of any sandbox (leases:, presence:, load:own:, load:tier:).
_PRUNE = {"leases", "presence", "load"}
#: The fair queue's keys (``q:...``, and a node's slot queue ``qn:<node>:...``,
#: ``_queue.lua``) and its fairness counts (``fairness:<window>``) are built from
#: the limits key's base, in admission's slot: admit.lua reads ``q:serving`` and a
#: free node's ``qn:<node>:serving``; the scripts that grant read and reserve what
#: they grant: the nodes' slots, and a key's lease, pending entry and tokens under
#: its limits and live count (SPEC Q1).
_QUEUE = {"q", "qn", "fairness"}
_GRANTS = _QUEUE | {"slots", "limits", "inflight", "pending", "bucket", "live", "live-state"}
#: The decision log's sandbox streams, their sets and its index (``decisions:...``)
#: are built from the declared key's stream name and base (``_decision_stream.lua``);
#: decision_append.lua names each entry's stream in its arguments (SPEC N3).
_LOG = {"decisions"}
DERIVED: dict[str, set[str]] = {
    "admission/admit": _QUEUE | _LOG,
    "admission/enqueue": _GRANTS,
    "admission/tick": _GRANTS,
    "admission/claim": _GRANTS | _LOG,
    "admission/leave": _GRANTS,
    "admission/reserve_warm": _QUEUE,
    "admission/fairness": _QUEUE,
    "admission/peek": _QUEUE,
    "admission/queue_position": _QUEUE,
    "admission/commit_hold": {"inflight", "sandbox", "slots"} | _GRANTS,
    "admission/cancel_hold": {"bucket", "inflight", "pending", "slots"} | _GRANTS,
    "admission/release_sandbox": {"pending", "slots"} | _GRANTS,
    "affinity/place": _PRUNE | {"detached", "wake"},
    "affinity/prepare": _PRUNE | {"detached", "wake"},
    "affinity/claim": _PRUNE,
    "affinity/replace": _PRUNE,
    "affinity/release": {"leases", "presence", "load"},
    "affinity/attach": _PRUNE,
    "affinity/heartbeat": _PRUNE,
    "affinity/detach": {"load"},
    "affinity/workers": _PRUNE,
    "platform/decision_append": _LOG,
}


def tag_of(key: str) -> str:
    return key[key.index("{") : key.index("}") + 1]


def kind_of(key: str) -> str:
    return key[key.index("}") + 2 :].split(":", 1)[0]


def test_every_lua_file_is_a_script_checked_here_or_a_prelude() -> None:
    """A new script cannot skip the cluster check below: it must be named here."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.lua"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split()
    names = {Path(path).stem for path in tracked}
    assert names == {name.split("/")[1] for name in SCRIPTS} | PRELUDES


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_script_is_a_redis_7_script_with_flags(name: str) -> None:
    """``#!lua`` first: a cluster node then refuses a key of another slot than the
    first one touched even when it holds both slots, and Redis refuses an
    out-of-memory write before the script starts."""
    assert SCRIPTS[name].startswith("#!lua\n")


def test_a_redis_prefix_with_a_brace_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="redis_prefix"):
        ServiceSettings(redis_prefix="turnstile{a}:")


@pytest.fixture
async def masters(redis_cluster: RedisClusterServers) -> AsyncIterator[list[aioredis.Redis]]:
    """A plain client to each master (MONITOR and COMMAND GETKEYS are per node)."""
    clients = []
    for port in redis_cluster.ports:
        client = aioredis.Redis(host="127.0.0.1", port=port)
        role = await client.role()
        if role[0] in (b"master", "master"):
            clients.append(client)
        else:
            await client.aclose()
    yield clients
    for client in clients:
        await client.aclose()


async def test_a_script_touching_a_key_of_another_slot_is_refused_by_the_cluster(
    redis_cluster_client: RedisCluster, redis_prefix: str
) -> None:
    """The check below can fail: a key built outside the declared key's tag errors."""
    script = "#!lua\nredis.call('SET', KEYS[1], 1)\nreturn redis.call('GET', ARGV[1])"
    declared, other = f"{redis_prefix}{{adm}}:x", f"{redis_prefix}{{affinity}}:x"
    assert key_slot(declared.encode()) != key_slot(other.encode())
    with pytest.raises(ResponseError, match=r"slot|non local key"):
        await redis_cluster_client.eval(script, 1, declared, other)


async def test_only_the_lua_flags_line_stops_a_script_crossing_slots_on_one_node(
    redis_cluster_client: RedisCluster, redis_prefix: str
) -> None:
    """Why every script starts ``#!lua``: a node holding both slots lets an
    old-style script through."""
    declared = f"{redis_prefix}{{adm}}:x"
    await redis_cluster_client.initialize()  # the slot map
    node = redis_cluster_client.get_node_from_key(declared)
    other = next(
        key
        for key in (f"{redis_prefix}{{other-{n}}}:x" for n in range(10_000))
        if key_slot(key.encode()) != key_slot(declared.encode())
        and redis_cluster_client.get_node_from_key(key) == node
    )
    body = "redis.call('SET', KEYS[1], 1)\nreturn redis.call('GET', ARGV[1])"
    assert await redis_cluster_client.eval(body, 1, declared, other) is None
    with pytest.raises(ResponseError, match="same slot"):
        await redis_cluster_client.eval("#!lua\n" + body, 1, declared, other)


async def test_a_key_touched_without_being_declared_is_reported(
    redis_cluster_client: RedisCluster, masters: list[aioredis.Redis], redis_prefix: str
) -> None:
    """The recorder can fail too: a same-slot key that a cluster lets through."""
    script = "#!lua\nredis.call('SET', KEYS[1], 1)\nreturn redis.call('GET', KEYS[1] .. ':more')"
    declared = f"{redis_prefix}{{adm}}:x"
    async with ScriptKeyRecorder(masters, {script: "probe"}, redis_prefix) as recorder:
        await redis_cluster_client.eval(script, 1, declared)
        (run,) = await recorder.runs()
    assert (run.script, run.declared, run.undeclared()) == (
        "probe",
        [declared],
        {f"{declared}:more"},
    )


@pytest.mark.parametrize("calls_first", [False, True])
def test_the_recorder_gives_each_script_its_own_commands_in_either_log_order(
    calls_first: bool,
) -> None:
    """Redis 7.0 logs a script's EVALSHA before its commands; the order is calibrated
    per node, so both must group the same way."""
    scripts = [
        ('"evalsha" "aaa" "1" "p:{t}:one"', ['"GET" "p:{t}:one"']),
        ('"evalsha" "bbb" "1" "p:{t}:two"', ['"SET" "p:{t}:two" "1"', '"TIME"']),
    ]
    lines = ['1.0 [0 127.0.0.1:1] "echo" "unrelated"']
    for call, commands in scripts:
        inner = [f"1.0 [0 lua] {command}" for command in commands]
        outer = [f"1.0 [0 127.0.0.1:1] {call}"]
        lines += inner + outer if calls_first else outer + inner
    parsed = [p for p in map(parse_line, lines) if p is not None]
    runs = group_runs(parsed, names={"aaa": "a"}, prefix="p:", calls_first=calls_first)
    assert [(r.script, r.declared, r.commands) for r in runs] == [
        ("a", ["p:{t}:one"], [["GET", "p:{t}:one"]]),
        ("bbb", ["p:{t}:two"], [["SET", "p:{t}:two", "1"], ["TIME"]]),
    ]


async def _admission_calls(client: aioredis.Redis, prefix: str) -> None:
    settings = AdmissionSettings(
        redis_prefix=prefix, cap=CapSettings(default_cap=5), hold_ttl_s=10
    )  # the production scripts: no test clock, no test-clock key
    store = AdmissionStore(client, settings)
    modes = {PolicyName.CAP: 2, PolicyName.RATE: 2, PolicyName.CONCURRENCY: 2, PolicyName.SLOTS: 2}

    def admit(hold: str, sandbox: str, node: str) -> AdmitArgs:
        return AdmitArgs(hold, "acme", sandbox, modes, nodes=[(node, 5)])

    assert (await store.admit(admit("h1", "sb-1", "n1"))).outcome == "admit"
    assert await store.commit("h1")
    assert (await store.admit(admit("h2", "sb-2", "n1"))).outcome == "admit"
    assert (await store.cancel("h2")).cancelled
    # sb-1 again, on another node: committing moves its slot off n1.
    assert (await store.admit(admit("h3", "sb-1", "n2"))).outcome == "admit"
    assert await store.commit("h3")
    assert (await store.usage("acme")).node_slots_held == {"n2": 1}
    assert await store.release("sb-1")
    # The fair queue, through its callers: a waiter joins, a tick grants it the
    # cluster bucket's token, it claims (admit.lua wrapped: one decision, logged
    # once), and a second waiter leaves before its grant.
    joined = await store.enqueue("w1", "acme", "replica-1", budget_ms=10_000, ttl_ms=60_000)
    assert joined.queued
    assert "w1" in (await store.tick("replica-1")).granted
    assert (await store.admit(admit("h4", "sb-4", "n1"), claim="w1")).outcome == "admit"
    assert (await store.enqueue("w2", "acme", "replica-1", budget_ms=10_000, ttl_ms=60_000)).queued
    assert (await store.leave("w2"))[0]
    # A slot waiter: n3's one slot is taken, a waiter joins its queue, the cancel
    # that frees the slot grants it, the claim takes it; another waiter is
    # granted by a release and leaves, passing the slot on to no one.
    n3 = [("n3", 1)]
    assert (await store.admit(AdmitArgs("h5", "acme", "sb-5", modes, nodes=n3))).outcome == "admit"
    assert await store.commit("h5")
    for waiter in ("w3", "w4"):
        joined = await store.enqueue(waiter, "acme", "replica-1", 10_000, 60_000, n3)
        assert joined.queued
    assert await store.release("sb-5")
    assert "w3" in (await store.tick("replica-1")).granted
    claimed = await store.admit(AdmitArgs("h6", "acme", "sb-6", modes, nodes=n3), claim="w3")
    assert claimed.outcome == "admit"
    assert (await store.cancel("h6")).cancelled
    assert (await store.leave("w4"))[0]
    # Per-client waiters (queue_per_client), granted as they join (acme has
    # room under its concurrency and bucket): one claims, one leaves with its
    # grant; commit and cancel look for the key's waiters.
    own = OwnLimits(cap=False, concurrency=True, rate=True)
    for waiter in ("w5", "w6"):
        joined = await store.enqueue(waiter, "acme", "replica-1", 10_000, 60_000, own=own)
        assert joined.queued
    assert {"w5", "w6"} <= set((await store.tick("replica-1")).granted)
    assert (await store.admit(admit("h7", "sb-7", "n1"), claim="w5")).outcome == "admit"
    assert await store.commit("h7")
    assert (await store.leave("w6"))[0]
    # The warm-pool refill (SPEC W3): a warm pod's reservation, committed, released
    # when the pod goes; a claim of a paid warm pod gives its cluster token back.
    assert (await store.reserve_warm("h8", "warm-a", [("n1", 5)])).outcome == "reserved"
    assert await store.commit("h8")
    assert await store.release("warm-a")
    assert (await store.admit(admit("h9", "sb-9", "n1"))).outcome == "admit"
    assert (await store.commit_answer("h9", prepaid=True)).committed
    assert await store.fairness_counts()
    assert (await store.peek("acme")).position >= 1
    assert (await store.queue_position("w-none")).state == "none"

    live = LiveStore(client, prefix, state_ttl_s=60)
    await live.write(1, [Change(Op.SET, "sb-1", "acme"), Change(Op.DEL, "sb-2", "acme")], COUNTED)


async def _credential_calls(client: aioredis.Redis, prefix: str, tmp_path: Path) -> None:
    private, public = tmp_path / "signing.pem", tmp_path / "public.pem"
    generate_key_pair(private, public)
    issuer = CredentialIssuer(SigningKey.from_file(private), client, prefix, ttl_s=60)
    issued = await issuer.issue("sb-1")
    assert await issuer.renew("sb-1", issued.generation) is not None
    assert await issuer.revoke_generation("sb-1", issued.generation)


async def _decision_log_calls(client: aioredis.Redis, prefix: str) -> None:
    """The substrate's and affinity's side of the decision log (admission's own
    entries are written by ``admit.lua``, run above)."""
    writer = DecisionLogWriter(client, prefix, DecisionLogSettings(), "substrate")
    writer.append("created", sandbox_id="sb-1", client="acme")
    writer.append("created", sandbox_id="sb-1", client="acme", key="acme")
    writer.append("reaped")
    await writer.close()


async def _affinity_calls(client: aioredis.Redis, prefix: str) -> None:
    store = AffinityStore(client, prefix)
    ttl = 60_000

    async def attach(sandbox: str, tier: str) -> None:
        status, _ = await store.attach(
            sandbox_id=sandbox,
            owner=f"owner-{sandbox}",
            tier=tier,
            capacity=2,
            labels={"turnstile.dev/tier": tier},
            endpoint="",
            presence_ttl_ms=ttl,
            generation="",
            client="acme",
        )
        assert status == "ok"

    def turn(lease: str) -> Turn:
        return Turn("s1", "a", True, lease, ttl, ttl, "acme", True)

    await attach("sb-1", "a")
    await attach("sb-2", "a")
    assert (
        await store.heartbeat(
            sandbox_id="sb-1", owner="owner-sb-1", presence_ttl_ms=ttl, generation=""
        )
        == "ok"
    )
    assert isinstance(await store.place(turn("l1"), grace_ms=10_000), NoRecord)
    first = await store.claim(turn("l1"))
    assert isinstance(first, Leased)
    assert first.sandbox_id == "sb-1"
    assert isinstance(await store.place(turn("l2"), grace_ms=10_000), Leased)
    assert await store.release("l1")
    assert {w.sandbox_id for w in await store.workers(None)} == {"sb-1", "sb-2"}
    assert len(await store.workers("a")) == 2
    assert (await store.session("s1", "acme")) is not None
    assert (await store.prepare("s1", "acme", grace_ms=10_000, mark_ttl_ms=ttl)).state == "running"
    # sb-1 re-tiered (its old tier's index is found by reading): the session moves.
    await attach("sb-1", "b")
    moved = await store.place(turn("l3"), grace_ms=10_000)
    assert isinstance(moved, MustMove)
    assert moved.reason == "retiered"
    assert isinstance(
        await store.replace(turn("l3"), expected_sandbox_id="sb-1", reason="retiered"), Leased
    )
    # sb-2 leaves: pending within the grace, then past it (and past every lease
    # and presence ttl, so the scripts prune them).
    assert await store.detach(sandbox_id="sb-2", owner="owner-sb-2", mark_ttl_ms=ttl)
    assert isinstance(await store.place(turn("l4"), grace_ms=10_000), Pending)
    assert (await store.prepare("s1", "acme", grace_ms=10_000, mark_ttl_ms=ttl)).state == "pending"
    store.clock.offset_ms += 2 * ttl
    assert isinstance(await store.place(turn("l4"), grace_ms=10_000), MustMove)
    await store.replace(turn("l4"), expected_sandbox_id="sb-2", reason="grace")
    await store.workers(None)


async def test_every_script_runs_on_a_cluster_and_declares_what_it_touches(
    redis_cluster_client: RedisCluster,
    masters: list[aioredis.Redis],
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    client = cast(aioredis.Redis, redis_cluster_client)
    names = {text: name for name, text in SCRIPTS.items()}
    async with ScriptKeyRecorder(masters, names, redis_prefix) as recorder:
        await _admission_calls(client, redis_prefix)
        await _credential_calls(client, redis_prefix, tmp_path)
        await _decision_log_calls(client, redis_prefix)
        await _affinity_calls(client, redis_prefix)
        runs = await recorder.runs()

    assert {run.script for run in runs} == set(SCRIPTS), "every script ran"
    problems = []
    for run in runs:
        tags = {tag_of(key) for key in run.declared}
        if len(tags) != 1:
            problems.append(f"{run.script} declares keys of several tags: {run.declared}")
        for key in sorted(run.undeclared()):
            if tag_of(key) not in tags or kind_of(key) not in DERIVED.get(run.script, set()):
                problems.append(f"{run.script} touched {key} without declaring it")
    assert problems == []
