"""The admission scripts and their arguments: the only code that talks to Redis on
the decision path.

Each RPC is one script (EVALSHA; redis-py reloads it on NOSCRIPT after a Redis
restart). ``_common.lua`` is prepended to each, so helpers such as the bucket
arithmetic exist once.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from turnstile_admission.keys import AdmissionKeys
from turnstile_admission.policies import PolicyName, RawResult
from turnstile_admission.settings import AdmissionSettings
from turnstile_platform.decision_log import bounds as log_bounds
from turnstile_platform.redis_client import read_script

_PACKAGE = "turnstile_admission"
#: The order ``admit.lua`` evaluates and answers the policies in.
SCRIPT_ORDER = (PolicyName.SLOTS, PolicyName.CONCURRENCY, PolicyName.CAP, PolicyName.RATE)


#: The fair queue's scripts, which take ``_queue.lua``'s helpers too.
QUEUE_SCRIPTS = frozenset(
    {
        "enqueue.lua",
        "tick.lua",
        "claim.lua",
        "leave.lua",
        "fairness.lua",
        "peek.lua",
        "queue_position.lua",
    }
)

#: The scripts that free node slots or a key's room (a lease, a pending entry,
#: tokens), and grant them to the waiters first (``_grant_freed.lua``, SPEC Q1).
FREEING_SCRIPTS = frozenset({"commit_hold.lua", "cancel_hold.lua", "release_sandbox.lua"})

#: The scripts that grant freed room to the waiters before deciding anything:
#: those that free it, and the decisions (room under a key's own limits frees by
#: itself too: its bucket refills, a lease expires; ``admit.lua`` hands it to the
#: key's own queue before judging a call from outside it).
GRANTING_SCRIPTS = FREEING_SCRIPTS | {"admit.lua", "claim.lua"}

#: The fair queue's helpers.
_QUEUE_HELPERS = ("_queue.lua", "_own_queue.lua")

#: The includes a script needs beyond ``_common.lua``: the decision scripts append
#: to the decision log (``_decision_log.lua``), the queue's take its helpers.
INCLUDES: dict[str, tuple[str, ...]] = {
    "admit.lua": ("_decision_log.lua",),
    "claim.lua": ("_decision_log.lua", *_QUEUE_HELPERS),
    **dict.fromkeys(QUEUE_SCRIPTS - {"claim.lua"}, _QUEUE_HELPERS),
}


def script_text(name: str, test_clock: bool = False) -> str:
    """The full text of one script: the shared helpers (with ``test_clock``, the
    frozen clock of ``_test_clock.lua`` over them), its own includes, then the script.

    ``claim.lua`` is a granted waiter's ``admit.lua``: admit.lua's text, wrapped
    as the function ``admit_body`` (a chunk's ``return`` is then the function's),
    comes before it, so it takes admit.lua's includes too (its decision is logged
    once, by admit_body: SPEC Q3).

    A script that frees a slot or a key's room, or decides (:data:`GRANTING_SCRIPTS`,
    run on every activation) takes the queue's helpers wrapped as the function
    ``queue_helpers``, called only when there are waiters to grant to
    (``_grant_freed.lua``): a script's top level makes a closure of every local
    function on every run."""
    parts = [
        "_common.lua",
        *(["_test_clock.lua"] if test_clock else []),
        *INCLUDES.get(name, ()),
    ]
    texts = [read_script(_PACKAGE, part) for part in parts]
    if "_decision_log.lua" in parts:
        # Each stream's append and bounds, shared with the platform's appends.
        at = parts.index("_decision_log.lua")
        texts.insert(at, read_script("turnstile_platform", "_decision_stream.lua"))
    if name in GRANTING_SCRIPTS:
        texts += [
            "local function queue_helpers()",
            *(read_script(_PACKAGE, part) for part in _QUEUE_HELPERS),
            "return {queue_keys = queue_keys, grant_slots = grant_slots, grant_own = grant_own}",
            "end",
            read_script(_PACKAGE, "_grant_freed.lua"),
        ]
    if name == "claim.lua":
        texts += ["local function admit_body()", read_script(_PACKAGE, "admit.lua"), "end"]
    texts.append(read_script(_PACKAGE, name))
    return "\n".join(texts)


class LogContext(NamedTuple):
    """What a decision's log entry carries that the script cannot know."""

    trace_id: str = ""
    """The call's trace id (hex), sampled or not; empty without a trace."""
    sampled: bool = False
    identity: str = ""
    """The caller's SPIFFE ID; empty on a server without authentication."""
    client: str = ""
    """The client as the caller named it (an id, ``native`` or ``unattributed``)."""
    key_kind: str = ""
    key_set_version: str = ""
    activation: str = ""
    """The activation's kind (``cold_create``, ...)."""
    wait_ms: str = ""
    """How long the call had waited in the fair queue, in ms; empty: it did not."""


_NO_LOG = LogContext()


class AdmitArgs(NamedTuple):
    """One decision's arguments. Named tuples here and in :class:`AdmitAnswer`:
    immutable, and built per decision at half a frozen dataclass's cost."""

    hold_id: str
    key: str
    sandbox_id: str
    modes: Mapping[PolicyName, int]
    """Per policy: 0 not evaluated, 1 shadow, 2 enforce."""
    nodes: Sequence[tuple[str, int]] = ()
    """Candidate nodes with their slot capacity, in preference order."""
    dry_run: bool = False
    """Decide and report, take nothing, log nothing (SPEC Q4)."""
    log: LogContext | None = None
    """What the decision log records beside the decision (SPEC Q3)."""
    defer: bool = False
    """The call may wait in the fair queue (SPEC Q1): a refusal only a shared
    resource made (the cluster bucket, or node slots) is not logged, the wait's
    final decision is."""
    defer_own: bool = False
    """With ``defer``: so is a refusal only the key's own limits made (the call
    waits for them: ``queue_per_client``)."""


class OwnLimits(NamedTuple):
    """The client's own limits a per-client waiter enforces, whose room its
    grant waits for and reserves (``_own_queue.lua``)."""

    cap: bool
    concurrency: bool
    rate: bool


#: How much longer than its TTL a hold record is kept (``admit.lua``), so a late
#: commit or cancel can tell "expired" from "never taken".
HOLD_RECORD_GRACE_MS = 60_000


#: How a script reports the live count when it has none.
LIVE_UNSUPPORTED, LIVE_UNAVAILABLE, LIVE_NOT_READ = -1, -2, -3
#: The cap's detail when the substrate cannot count (its fail-open ``backend`` label
#: is ``unsupported``, not an outage).
UNSUPPORTED_DETAIL = "live count unsupported by the substrate"


@dataclass(frozen=True)
class LiveCount:
    """A key's live sandboxes as a script read them from the leader's live set.

    Two unknowns, never to be confused: ``unsupported`` (the substrate cannot
    count at all, as Direct: the cap answers UNKNOWN and admits, SPEC S4, unless
    the pending set alone reaches the cap) and
    *unavailable* (no leader, or a leader behind: the ``live-state`` marker is
    missing): a lower bound of zero, so the cap still refuses on the pending set
    alone (SPEC P1).
    """

    live: int | None
    unsupported: bool = False

    @classmethod
    def from_script(cls, value: int) -> LiveCount:
        if value >= 0:
            return cls(value)
        return _LIVE_UNSUPPORTED if value == LIVE_UNSUPPORTED else _LIVE_UNKNOWN

    @property
    def detail(self) -> str:
        if self.live is not None:
            return ""
        if self.unsupported:
            return UNSUPPORTED_DETAIL
        return "live count unavailable: no current count from the substrate's leader"


# The counts without a number, shared: a resume's script reads none (the cap does
# not apply), so each resume would otherwise build one.
_LIVE_UNSUPPORTED = LiveCount(None, unsupported=True)
_LIVE_UNKNOWN = LiveCount(None)

#: What ``admit.lua`` answers for a policy it did not evaluate (``{0, 0, 0, -1, ''}``),
#: shared by every such answer: nothing of it but its code is ever read.
NOT_EVALUATED = RawResult(RawResult.NOT_EVALUATED, 0, 0, -1, "")


class AdmitAnswer(NamedTuple):
    outcome: str
    """``admit``, ``refuse`` or ``cancelled`` (the hold was cancelled before the
    script reached Redis: nothing was evaluated or taken)."""
    now_ms: int
    hold_expires_ms: int
    node: str
    results: Mapping[PolicyName, RawResult]
    pending_count: int
    live: LiveCount
    pending_expired: int = 0
    """Pending entries this call dropped because they expired unconsumed."""
    shadow: Mapping[PolicyName, ShadowResult] = {}
    """The shadow limits' results (SPEC Q4), by the policy each shadows; a policy
    without a shadow limit is left out."""


class ShadowResult(NamedTuple):
    """A shadow limit's part of ``admit.lua``'s answer."""

    over: bool
    limit: int
    current: int


#: The order ``admit.lua`` answers the shadow limits in.
SHADOW_ORDER = (PolicyName.CONCURRENCY, PolicyName.CAP, PolicyName.RATE)


class Queued(NamedTuple):
    """``enqueue.lua``'s answer."""

    queued: bool
    """False: the queue is full (``queue.max_waiters``), or the key's share of it
    (``key_full``)."""
    position: int
    """Among the key's waiters, 1 the head."""
    estimated_wait_ms: int
    """-1: no estimate (the cluster bucket has no rate, or a node's slots' or the
    key's own queue has not been granted lately: ``_queue.lua``'s pace)."""
    waiters: int
    """All the queue's waiters; with ``key_full``, the key's in the queue it
    would have joined."""
    level: str
    """The priority level it waits in (SPEC Q2)."""
    taken: bool = False
    """Not queued: the waiter id is already waiting (a reused ``wait_id``)."""
    key_full: bool = False
    """Not queued: the key has ``queue.max_key_waiters`` waiting there already."""


class QueuePosition(NamedTuple):
    """``queue_position.lua``'s answer: one waiter, now."""

    state: str
    """``waiting``, ``granted`` (not yet claimed) or ``none`` (not in the queue)."""
    position: int
    """Among its key's waiters, 1 the head; 0 unless waiting."""
    key_waiters: int
    estimated_wait_ms: int
    """-1: no estimate (as :attr:`Queued.estimated_wait_ms`)."""
    waited_ms: int


class Tick(NamedTuple):
    """``tick.lua``'s answer."""

    granted: tuple[str, ...]
    """This replica's waiters granted since its last tick."""
    waiters: int
    grants: int
    swept: int
    returned: float
    lengths: dict[str, int]
    """Per priority level, its waiters not yet granted."""


@dataclass(frozen=True)
class CommitAnswer:
    committed: bool
    cluster_tokens: float = 0.0
    """Tokens returned to the cluster bucket (a prepaid warm pod's claim)."""


class WarmAnswer(NamedTuple):
    """``reserve_warm.lua``'s answer."""

    outcome: str
    """``reserved``, ``refused`` or ``cancelled`` (settled before it ran)."""
    now_ms: int
    hold_expires_ms: int
    node: str
    refused_by: str
    """``queue``, ``cluster bucket`` or ``node slots``; empty when reserved."""
    retry_ms: int
    """-1: no hint from the script."""
    cluster_tokens: float


@dataclass(frozen=True)
class CancelAnswer:
    cancelled: bool
    client_tokens: float = 0.0
    cluster_tokens: float = 0.0


@dataclass(frozen=True)
class UsageAnswer:
    pending_ids: tuple[str, ...]
    live: LiveCount
    client_tokens: float
    client_capacity: float
    cluster_tokens: float
    cluster_capacity: float
    in_flight: int
    concurrency_limit: int
    cap: int
    node_slots_held: dict[str, int] = field(default_factory=dict)
    pending_expired: int = 0
    """Pending entries this call dropped because they expired unconsumed."""


def _shadow(raw: Sequence[object]) -> Mapping[PolicyName, ShadowResult]:
    """The shadow limits of ``admit.lua``'s answer (after its 27 first values).

    Most keys set none: their three codes are the integer 0, answered without
    parsing anything (about 1 µs a decision)."""
    if raw[27] == 0 and raw[30] == 0 and raw[33] == 0:
        return _NO_SHADOW
    out: dict[PolicyName, ShadowResult] = {}
    at = 27
    for policy in SHADOW_ORDER:
        code = int(_s(raw[at]))
        if code:
            out[policy] = ShadowResult(code == 2, int(_s(raw[at + 1])), int(_s(raw[at + 2])))
        at += 3
    return out


#: The answer's shadow results when no shadow limit is set (never mutated).
_NO_SHADOW: Mapping[PolicyName, ShadowResult] = {}


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class AdmissionStore:
    """Runs the admission scripts against one Redis (one shard: one hash tag)."""

    def __init__(
        self, client: aioredis.Redis | aioredis.RedisCluster, settings: AdmissionSettings
    ) -> None:
        self.redis = client
        self.keys = AdmissionKeys(settings.redis_prefix)
        self._settings = settings
        clock = settings.test_clock
        self._admit: AsyncScript = client.register_script(script_text("admit.lua", clock))
        self._commit: AsyncScript = client.register_script(script_text("commit_hold.lua", clock))
        self._cancel: AsyncScript = client.register_script(script_text("cancel_hold.lua", clock))
        self._release: AsyncScript = client.register_script(
            script_text("release_sandbox.lua", clock)
        )
        self._usage: AsyncScript = client.register_script(script_text("usage.lua", clock))
        self._reserve_warm: AsyncScript = client.register_script(
            script_text("reserve_warm.lua", clock)
        )
        self._enqueue: AsyncScript = client.register_script(script_text("enqueue.lua", clock))
        self._tick: AsyncScript = client.register_script(script_text("tick.lua", clock))
        self._claim: AsyncScript = client.register_script(script_text("claim.lua", clock))
        self._leave: AsyncScript = client.register_script(script_text("leave.lua", clock))
        self._fairness: AsyncScript = client.register_script(script_text("fairness.lua", clock))
        self._peek: AsyncScript = client.register_script(script_text("peek.lua", clock))
        self._position: AsyncScript = client.register_script(
            script_text("queue_position.lua", clock)
        )
        s = settings
        #: The levels' shares as the queue's scripts take them (JSON).
        self._shares = json.dumps(s.queue.level_shares, sort_keys=True)
        #: The limits' defaults as ``_own_queue.lua`` takes them (JSON).
        self._defaults_json = json.dumps(
            {
                "cap": s.cap.default_cap,
                "rate": s.rate.default_rate_per_s,
                "burst": s.rate.default_burst,
                "concurrency": s.concurrency.default_limit,
            }
        )
        self._key_defaults = [
            s.cap.default_cap,
            s.rate.default_rate_per_s,
            s.rate.default_burst,
            s.concurrency.default_limit,
            s.rate.cluster_rate_per_s,
            s.rate.cluster_burst,
        ]
        self._bucket_defaults = [
            s.rate.default_rate_per_s,
            s.rate.default_burst,
            s.rate.cluster_rate_per_s,
            s.rate.cluster_burst,
        ]
        #: With ``test_clock``, the test-clock key, the last of every script's KEYS
        #: (``_test_clock.lua``); production calls carry no test-only key.
        self._clock_keys: tuple[bytes, ...] = (
            (self.keys.test_clock.encode(),) if s.test_clock else ()
        )
        #: A settled hold's tombstone lives as long as a hold record would (see
        #: ``admit.lua``): longer than the hold a late script could take.
        self._tombstone_ttl_ms = round(s.hold_ttl_s * 1000) + HOLD_RECORD_GRACE_MS
        # What does not change between decisions is built once: the fixed keys,
        # each bounded key's own keys (bounded by the key set, SPEC C3), each
        # node's slots key (bounded by the cluster's nodes) and the settings'
        # part of the arguments. Formatting them per call was a visible share of
        # an Admit (docs/performance.md).
        # Keys are kept encoded, as redis-py would send them.
        k = self.keys
        self._fixed_keys = tuple(
            name.encode() for name in (k.limits, k.cluster_bucket, k.nodes, k.live_state)
        )
        self._per_key: dict[str, tuple[bytes, ...]] = {}
        # A hold's own keys are its id after a fixed prefix (``keys.hold``,
        # ``keys.settled``): the prefix is formatted once, not per decision.
        self._hold_prefix = k.hold("")
        self._settled_prefix = k.settled("")
        self._slots_keys: dict[str, bytes] = {}
        # Encoded as redis-py would encode them (``repr`` of a number), once.
        self._argv_tail: tuple[bytes, ...] = tuple(
            repr(value).encode()
            for value in (
                *self._key_defaults,
                s.rate.cost,
                round(s.hold_ttl_s * 1000),
                round(s.pending_ttl_s * 1000),
                *log_bounds(s.decision_log),
            )
        )
        # Every activation's Admit is followed by a CommitHold or a CancelHold:
        # their fixed keys and arguments are built once too.
        limits, cluster_bucket, nodes, _ = self._fixed_keys
        self._commit_nodes = nodes
        self._cancel_keys = (limits, cluster_bucket)
        self._commit_args = (
            round(s.slots.committed_ttl_s * 1000),
            round(s.pending_ttl_s * 1000),
            self._tombstone_ttl_ms,
        )
        self._cluster_defaults = (s.rate.cluster_rate_per_s, s.rate.cluster_burst)
        self._cancel_args = (*self._bucket_defaults, self._tombstone_ttl_ms)

    def _keys_of(self, key: str) -> tuple[bytes, ...]:
        """``key``'s pending, bucket, in-flight, live, shadow-bucket and decision-log keys."""
        keys = self._per_key.get(key)
        if keys is None:
            k = self.keys
            names = (
                k.pending(key),
                k.bucket(key),
                k.inflight(key),
                k.live(key),
                k.shadow_bucket(key),
                k.decision_stream(key),
            )
            keys = self._per_key[key] = tuple(name.encode() for name in names)
        return keys

    def _slots_key(self, node: str) -> bytes:
        name = self._slots_keys.get(node)
        if name is None:
            name = self._slots_keys[node] = self.keys.slots(node).encode()
        return name

    def admit_request(
        self, args: AdmitArgs
    ) -> tuple[list[bytes | str], list[str | int | float | bytes]]:
        """The KEYS and ARGV of ``admit.lua`` for one decision, as sent (the parts
        that do not change between decisions already encoded; the slot benchmark
        replays them)."""
        limits, cluster_bucket, nodes, live_state = self._fixed_keys
        pending, bucket, inflight, live, shadow_bucket, decisions = self._keys_of(args.key)
        keys: list[bytes | str] = [
            limits,
            pending,
            bucket,
            cluster_bucket,
            inflight,
            self._hold_prefix + args.hold_id,
            nodes,
            live,
            live_state,
            self._settled_prefix + args.hold_id,
            decisions,
            shadow_bucket,
            *(self._slots_key(name) for name, _ in args.nodes),
            *self._clock_keys,
        ]
        modes = args.modes
        log = args.log or _NO_LOG
        argv: list[str | int | float | bytes] = [
            args.hold_id,
            args.key,
            args.sandbox_id,
            modes[PolicyName.CAP],
            modes[PolicyName.RATE],
            modes[PolicyName.CONCURRENCY],
            modes[PolicyName.SLOTS],
            *self._argv_tail,
            1 if args.dry_run else 0,
            log.trace_id,
            1 if log.sampled else 0,
            log.identity,
            log.client,
            log.key_kind,
            log.key_set_version,
            log.activation,
            log.wait_ms,
            2 if args.defer_own else 1 if args.defer else 0,
            len(args.nodes),
        ]
        for name, capacity in args.nodes:
            argv += [name, capacity]
        return keys, argv

    async def admit(self, args: AdmitArgs, claim: str = "") -> AdmitAnswer:
        """One decision; with ``claim`` (a granted waiter's id), the waiter's,
        through ``claim.lua`` (outcome ``lost`` when it holds no grant)."""
        keys, argv = self.admit_request(args)
        if claim:
            raw = await self._claim(keys=keys, args=[*argv, claim])
            if _s(raw[0]) == "lost":
                return AdmitAnswer("lost", 0, 0, "", {}, 0, _LIVE_UNKNOWN)
        else:
            raw = await self._admit(keys=keys, args=argv)
        results = {}
        at = 4
        for policy in SCRIPT_ORDER:
            code = int(raw[at])
            results[policy] = (
                NOT_EVALUATED
                if code == RawResult.NOT_EVALUATED
                else RawResult(
                    code, int(raw[at + 1]), int(raw[at + 2]), int(raw[at + 3]), _s(raw[at + 4])
                )
            )
            at += 5
        return AdmitAnswer(
            _s(raw[0]),
            int(raw[1]),
            int(raw[2]),
            _s(raw[3]),
            results,
            int(raw[24]),
            LiveCount.from_script(int(raw[25])),
            int(raw[26]),
            _shadow(raw),
        )

    async def commit(self, hold_id: str) -> bool:
        return (await self.commit_answer(hold_id)).committed

    async def commit_answer(self, hold_id: str, prepaid: bool = False) -> CommitAnswer:
        """Commit a hold; ``prepaid``: its runtime is a warm pod whose creation
        ``reserve_warm.lua`` paid, so the hold's cluster tokens go back (SPEC W3)."""
        raw = await self._commit(
            keys=[
                self._hold_prefix + hold_id,
                self._commit_nodes,
                self._settled_prefix + hold_id,
                *self._cancel_keys,
                *self._clock_keys,
            ],
            args=[hold_id, *self._commit_args, 1 if prepaid else 0, *self._cluster_defaults],
        )
        return CommitAnswer(bool(int(raw[0])), float(_s(raw[1])))

    async def reserve_warm(
        self, hold_id: str, pod: str, nodes: Sequence[tuple[str, int]]
    ) -> WarmAnswer:
        """A warm pod's creation token and node slot as a hold, or nothing (SPEC W3)."""
        s = self._settings
        limits, cluster_bucket, registry, _ = self._fixed_keys
        argv: list[str | int | float] = [
            hold_id,
            pod,
            *self._cluster_defaults,
            s.rate.cost,
            round(s.hold_ttl_s * 1000),
            s.warm.cluster_reserve,
            s.warm.spare_slots,
            len(nodes),
        ]
        for name, capacity in nodes:
            argv += [name, capacity]
        raw = await self._reserve_warm(
            keys=[
                limits,
                cluster_bucket,
                self._hold_prefix + hold_id,
                self._settled_prefix + hold_id,
                registry,
                *(self._slots_key(name) for name, _ in nodes),
                *self._clock_keys,
            ],
            args=argv,
        )
        return WarmAnswer(
            _s(raw[0]),
            int(raw[1]),
            int(raw[2]),
            _s(raw[3]),
            _s(raw[4]),
            int(raw[5]),
            float(_s(raw[6])),
        )

    async def cancel(self, hold_id: str) -> CancelAnswer:
        raw = await self._cancel(
            keys=[
                self._hold_prefix + hold_id,
                *self._cancel_keys,
                self._settled_prefix + hold_id,
                *self._clock_keys,
            ],
            args=[hold_id, *self._cancel_args],
        )
        return CancelAnswer(bool(int(raw[0])), float(_s(raw[1])), float(_s(raw[2])))

    async def release(self, sandbox_id: str) -> bool:
        k = self.keys
        done = await self._release(
            keys=[k.sandbox(sandbox_id), *self._clock_keys], args=[sandbox_id]
        )
        return bool(done)

    async def decision_streams(self, limit: int) -> list[str]:
        """The decision log's streams its index lists, most recently trimmed first,
        at most ``limit`` (SPEC N3: one per bounded key, and the platform's)."""
        names = await self.redis.zrange(self.keys.decision_streams, 0, limit - 1, desc=True)
        return [n.decode() if isinstance(n, bytes) else str(n) for n in names]

    async def usage(self, key: str) -> UsageAnswer:
        k = self.keys
        # The script declares every key it reads, so the nodes' slot keys are
        # read first (an operator's call: one more round trip is cheap).
        nodes = sorted(_s(node) for node in await self.redis.smembers(k.nodes))
        raw = await self._usage(
            keys=[
                k.limits,
                k.pending(key),
                k.bucket(key),
                k.cluster_bucket,
                k.inflight(key),
                k.nodes,
                k.live(key),
                k.live_state,
                *(self._slots_key(node) for node in nodes),
                *self._clock_keys,
            ],
            args=[key, *self._key_defaults, *nodes],
        )
        held = raw[8]
        return UsageAnswer(
            pending_ids=tuple(_s(m) for m in raw[0]),
            live=LiveCount.from_script(int(raw[9])),
            client_tokens=float(_s(raw[1])),
            client_capacity=float(_s(raw[2])),
            cluster_tokens=float(_s(raw[3])),
            cluster_capacity=float(_s(raw[4])),
            in_flight=int(raw[5]),
            concurrency_limit=int(raw[6]),
            cap=int(raw[7]),
            node_slots_held={_s(held[i]): int(held[i + 1]) for i in range(0, len(held), 2)},
            pending_expired=int(raw[10]),
        )

    async def enqueue(
        self,
        waiter: str,
        key: str,
        owner: str,
        budget_ms: int,
        ttl_ms: int,
        nodes: Sequence[tuple[str, int]] = (),
        own: OwnLimits | None = None,
    ) -> Queued:
        """Join the queue of the cluster bucket, or with ``nodes`` (candidate
        nodes with their slots) the queues of those nodes' slots, or with
        ``own`` the key's own queue, for room under those of its limits."""
        q = self._settings.queue
        raw = await self._enqueue(
            keys=[self.keys.limits, *self._clock_keys],
            args=[
                waiter,
                key,
                owner,
                budget_ms,
                q.max_waiters,
                round(q.owner_ttl_s * 1000),
                round(q.serving_ttl_s * 1000),
                self._settings.rate.cost,
                self._settings.rate.cluster_rate_per_s,
                ttl_ms,
                self._shares,
                q.default_level,
                round(q.claim_ttl_s * 1000),
                json.dumps({"cap": own.cap, "conc": own.concurrency, "rate": own.rate})
                if own is not None
                else "",
                self._defaults_json,
                q.max_key_waiters,
                len(nodes),
                *(part for pair in nodes for part in pair),
            ],
        )
        outcome = _s(raw[0])
        counts = int(raw[1]), int(raw[2]), int(raw[3])
        return Queued(
            outcome == "queued",
            *counts,
            _s(raw[4]),
            taken=outcome == "taken",
            key_full=outcome == "key_full",
        )

    async def queued(self, waiters: Sequence[str]) -> list[bool]:
        """Whether each waiter still has its entry in the fair queue (one HMGET,
        bounded by one replica's waiters)."""
        found = await self.redis.hmget(self.keys.queue_info, list(waiters))
        return [entry is not None for entry in found]

    async def peek(self, key: str) -> Queued:
        """Where a call of ``key`` would join the fair queue now (``peek.lua``),
        joining nothing: ``queued`` is True, ``waiters`` those already waiting."""
        q = self._settings.queue
        raw = await self._peek(
            keys=[self.keys.limits, *self._clock_keys],
            args=[
                key,
                self._settings.rate.cost,
                self._settings.rate.cluster_rate_per_s,
                self._shares,
                q.default_level,
            ],
        )
        return Queued(True, int(raw[0]), int(raw[1]), int(raw[2]), _s(raw[3]))

    async def queue_position(self, waiter: str) -> QueuePosition:
        """Where ``waiter`` stands in the fair queue now (``queue_position.lua``),
        changing nothing: polled by a caller while its Admit waits (SPEC Q1)."""
        raw = await self._position(
            keys=[self.keys.limits, *self._clock_keys],
            args=[
                waiter,
                self._settings.rate.cost,
                self._settings.rate.cluster_rate_per_s,
                self._shares,
            ],
        )
        return QueuePosition(_s(raw[0]), int(raw[1]), int(raw[2]), int(raw[3]), int(raw[4]))

    async def tick(self, owner: str) -> Tick:
        q = self._settings.queue
        rate = self._settings.rate
        raw = await self._tick(
            keys=[
                self.keys.limits,
                self.keys.cluster_bucket,
                self.keys.granted(owner),
                *self._clock_keys,
            ],
            args=[
                owner,
                rate.cluster_rate_per_s,
                rate.cluster_burst,
                rate.cost,
                q.max_grants_per_tick,
                round(q.owner_ttl_s * 1000),
                round(q.claim_ttl_s * 1000),
                round(q.serving_ttl_s * 1000),
                q.sweep_limit,
                self._shares,
            ],
        )
        lengths = raw[5]
        return Tick(
            tuple(_s(w) for w in raw[0]),
            int(raw[1]),
            int(raw[2]),
            int(raw[3]),
            float(_s(raw[4])),
            {_s(lengths[i]): int(lengths[i + 1]) for i in range(0, len(lengths), 2)},
        )

    async def leave(self, waiter: str) -> tuple[bool, float]:
        """The waiter leaves the queue: whether it was there, and the tokens of a
        grant it had not claimed, returned to the cluster bucket."""
        rate = self._settings.rate
        raw = await self._leave(
            keys=[self.keys.limits, self.keys.cluster_bucket, *self._clock_keys],
            args=[waiter, rate.cluster_rate_per_s, rate.cluster_burst],
        )
        return bool(int(raw[0])), float(_s(raw[1]))

    async def fairness_counts(self) -> list[tuple[str, str]]:
        """The fair queue's joins, grants and weights of the last minute, by level
        and key (``fairness.lua``), as (field, value) pairs."""
        raw = await self._fairness(keys=[self.keys.limits, *self._clock_keys], args=[])
        return [(_s(raw[i]), _s(raw[i + 1])) for i in range(0, len(raw), 2)]

    async def set_test_clock(self, now_ms: int) -> None:
        """Tests only (``test_clock``): freeze the scripts' clock at ``now_ms``."""
        await self.redis.set(self.keys.test_clock, now_ms)
