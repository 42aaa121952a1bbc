"""The Redis affinity store: sessions, presence, detach marks, leases, load index.

Every operation is one Lua script (``scripts/*.lua``, each prefixed with
``scripts/_lib.lua`` for the shared key names, time and load index), so each
decision is atomic and one round trip. The layout, under ``<prefix>{affinity}:``:

========================  =====================================================
``session:<client>/<id>`` hash: sandbox, tier, client, last reset; expires after
                          the TTL. Per client (SPEC O2): another client's session
                          of the same id is another key. ``session:<id>`` is a
                          record written before owners, adopted by place.lua
``presence:<sandbox>``    hash: owner stream, client (the sandbox's attested owner,
                          SPEC O3), tier, capacity, labels, endpoint, expiry
``presence-expiry``       sorted set ``<tier>/<sandbox>`` by expiry (pruning)
``detached:<sandbox>``    detach mark: ms when it left (or was first seen gone)
``wake:<sandbox>``        marker: this absence's wake was sent
``credential:<sandbox>``  the generation of the sandbox's current runtime,
                          written and revoked by the substrate (SPEC Z3)
``leases:<sandbox>``      sorted set of lease ids by expiry
``lease-expiry``          sorted set of every lease id by expiry (pruning)
``lease-sandbox``         hash: lease id → sandbox
``load:all``              sorted set of present sandboxes by leases/capacity
``load:own:<scope>:<c>``  the same, of the sandboxes client ``c`` owns in a tier, or
                          all of them (scope ``*``) when tiers do not filter (SPEC O2)
``load:tier:<tier>``      written before owners; emptied as presences attach again
========================  =====================================================

Every script declares in ``KEYS`` the shared indexes (:meth:`Keys.shared`) and
every key it can name before it runs; the keys it finds by reading (the sandbox a
record names or a pick chooses, entries a prune expires) carry the same hash tag
and are built from the base of ``KEYS[1]`` (``scripts/_lib.lua``, docs/scaling.md).

Time inside scripts is Redis ``TIME`` plus :attr:`Clock.offset_ms` (always 0 in
production; tests move it forward to cross a grace period without sleeping).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from turnstile_platform.redis_client import read_script

_PACKAGE = "turnstile_affinity.scripts"
#: Every affinity script (``scripts/<name>.lua``).
SCRIPTS = (
    "place",
    "claim",
    "replace",
    "release",
    "attach",
    "heartbeat",
    "detach",
    "session",
    "workers",
    "prepare",
)


def script_text(name: str) -> str:
    """The full text of one script: ``_lib.lua``, then the script."""
    return read_script(_PACKAGE, "_lib.lua") + read_script(_PACKAGE, f"{name}.lua")


@dataclass
class Clock:
    """Milliseconds added to Redis ``TIME`` in every script (tests only move it)."""

    offset_ms: int = 0


@dataclass(frozen=True)
class Keys:
    """Key names, as ``_lib.lua`` builds them (for tests and operators)."""

    prefix: str

    @property
    def base(self) -> str:
        return f"{self.prefix}{{affinity}}:"

    def session(self, session_id: str, client: str | None) -> str:
        """Client ``client``'s session ``session_id``; None: the ownerless record of
        the id (written before sessions had owners, SPEC O2). Session ids hold no
        ``/``, so the two never meet."""
        if client is None:
            return f"{self.base}session:{session_id}"
        return f"{self.base}session:{client}/{session_id}"

    def own_load(self, scope: str, client: str) -> str:
        """The load index of ``client``'s sandboxes in tier ``scope`` (``*``: all)."""
        return f"{self.base}load:own:{scope}:{client}"

    def presence(self, sandbox_id: str) -> str:
        return f"{self.base}presence:{sandbox_id}"

    def detached(self, sandbox_id: str) -> str:
        return f"{self.base}detached:{sandbox_id}"

    def wake(self, sandbox_id: str) -> str:
        return f"{self.base}wake:{sandbox_id}"

    def leases(self, sandbox_id: str) -> str:
        return f"{self.base}leases:{sandbox_id}"

    def credential(self, sandbox_id: str) -> str:
        return f"{self.base}credential:{sandbox_id}"

    def load(self, tier: str | None = None) -> str:
        """``load:all``; with a tier, the tier's index written before owners (SPEC O2
        replaced it by :meth:`own_load`; only its emptying remains)."""
        return f"{self.base}load:all" if tier is None else f"{self.base}load:tier:{tier}"

    @property
    def presence_expiry(self) -> str:
        return f"{self.base}presence-expiry"

    @property
    def lease_expiry(self) -> str:
        return f"{self.base}lease-expiry"

    @property
    def lease_sandbox(self) -> str:
        return f"{self.base}lease-sandbox"

    def shared(self) -> list[str]:
        """KEYS 1–4 of every script: the indexes ``_lib.lua`` keeps (load:all first,
        whose base the scripts build the keys they find by reading from)."""
        return [self.load(), self.presence_expiry, self.lease_expiry, self.lease_sandbox]

    def worker(self, sandbox_id: str) -> list[str]:
        """KEYS 5–8 of attach.lua: a worker's own keys (heartbeat and detach take a
        prefix of them)."""
        return [
            self.presence(sandbox_id),
            self.detached(sandbox_id),
            self.wake(sandbox_id),
            self.credential(sandbox_id),
        ]


#: The owner of the platform's shared pool (SPEC O2).
NATIVE = "native"


class Turn(NamedTuple):
    """What every placement script is told about one Place call.

    A named tuple rather than a frozen dataclass: one is built per ``Place``, and
    a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
    (1.0 against 0.25 µs here, docs/performance.md)."""

    session_id: str
    session_tier: str
    #: Whether tiers filter candidates (False: every present sandbox is one).
    filtered: bool
    #: Chosen before the scripts run, so a call that fails can return it by id.
    lease_id: str
    lease_ttl_ms: int
    record_ttl_ms: int
    #: The client the session belongs to (SPEC O2).
    client: str
    #: Whether the tier lets the session use the native shared pool.
    shared: bool

    @property
    def scope(self) -> str:
        """The owner load indexes' tier: the session's, or ``*`` when unfiltered."""
        return self.session_tier if self.filtered else "*"

    def keys(self, keys: Keys) -> list[str]:
        """KEYS 5–7 of place.lua, claim.lua and replace.lua."""
        return [
            keys.session(self.session_id, self.client),
            keys.own_load(self.scope, self.client),
            keys.own_load(self.scope, NATIVE),
        ]

    def args(self) -> list[str | int]:
        """ARGV 2–9 of place.lua, claim.lua and replace.lua."""
        return [
            self.session_id,
            self.session_tier,
            "1" if self.filtered else "0",
            self.lease_ttl_ms,
            self.lease_id,
            self.record_ttl_ms,
            self.client,
            "1" if self.shared else "0",
        ]


# Results of place.lua ------------------------------------------------------------


class Leased(NamedTuple):
    """A lease was taken on ``sandbox_id`` (hit, first turn or fallback).

    A named tuple, as :class:`Turn` is: every placement builds one. The other
    results stay dataclasses, whose equality compares their type too (two
    named tuples of the same fields compare equal whatever their class)."""

    sandbox_id: str
    tier: str
    lease_expires_ms: int
    endpoint: str
    reset_at_ms: int | None = None


@dataclass(frozen=True)
class NoRecord:
    """The session has no record: a first turn."""


@dataclass(frozen=True)
class Busy:
    sandbox_id: str
    tier: str
    leases: int
    capacity: int


@dataclass(frozen=True)
class Pending:
    """The session's sandbox is absent within the grace; ``woke``: wake it now."""

    sandbox_id: str
    remaining_grace_ms: int
    woke: bool


@dataclass(frozen=True)
class MustMove:
    """The session's sandbox is gone past the grace (``grace``), re-tiered
    (``retiered``) or no longer usable by the session's client (``not_owned``)."""

    sandbox_id: str
    reason: str


# Results of claim.lua / replace.lua -------------------------------------------


@dataclass(frozen=True)
class RecordMoved:
    """Another turn claimed or moved the session first: place again."""

    sandbox_id: str


@dataclass(frozen=True)
class Exhausted:
    """No sandbox of the tier has a free slot."""


PlaceResult = Leased | NoRecord | Busy | Pending | MustMove


# Results of prepare.lua ----------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """What ``prepare.lua`` found: ``state`` is ``none`` (no such session of the
    client), ``running`` (its sandbox is present), ``moves`` (absent past the
    grace) or ``pending`` (absent within it; ``woke``: this call owns the wake)."""

    state: str
    sandbox_id: str = ""
    tier: str = ""
    remaining_grace_ms: int = 0
    woke: bool = False


ClaimResult = Leased | RecordMoved | Exhausted


@dataclass(frozen=True)
class SessionRecord:
    sandbox_id: str
    tier: str
    expires_ms: int
    reset_from: str | None
    reset_to: str | None
    reset_at_ms: int | None
    reset_reason: str | None
    #: The client the session belongs to ("" for an ownerless record).
    client: str = ""


@dataclass(frozen=True)
class WorkerView:
    sandbox_id: str
    tier: str
    capacity: int
    leases: int
    labels: dict[str, str]
    #: The sandbox's attested owner ("" for none).
    client: str = ""


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class AffinityStore:
    """Typed calls of the affinity scripts against one Redis."""

    def __init__(
        self, redis: aioredis.Redis | aioredis.RedisCluster, prefix: str, clock: Clock | None = None
    ) -> None:
        self.redis = redis
        self.keys = Keys(prefix)
        self.clock = clock or Clock()
        self._shared = self.keys.shared()
        self._base = self.keys.base
        self._scripts: dict[str, AsyncScript] = {
            name: redis.register_script(script_text(name)) for name in SCRIPTS
        }
        # The two scripts of every turn, without the dict lookup.
        self._place = self._scripts["place"]
        self._release = self._scripts["release"]

    def request(
        self, name: str, keys: Sequence[str], *args: str | int
    ) -> tuple[list[str], list[str | int]]:
        """The KEYS and ARGV of script ``name``: the shared indexes, then ``keys``;
        the clock offset, then ``args``."""
        return [*self._shared, *keys], [self.clock.offset_ms, *args]

    def place_request(self, turn: Turn, *, grace_ms: int) -> tuple[list[str], list[str | int]]:
        """The KEYS and ARGV of ``place.lua`` (the slot benchmark replays them):
        what :meth:`request` makes of :meth:`Turn.keys` and :meth:`Turn.args`, the
        grace and the detach mark's TTL (a mark lives as long as the records that
        may name it), written out in one step because every ``Place`` builds them
        (0.85 against 0.33 µs, docs/performance.md; ``test_affinity_scripts.py``
        compares the two)."""
        base = self._base
        (
            session_id,
            session_tier,
            filtered,
            lease_id,
            lease_ttl_ms,
            record_ttl_ms,
            client,
            shared,
        ) = turn
        scope = session_tier if filtered else "*"
        keys = [
            *self._shared,
            f"{base}session:{client}/{session_id}",
            f"{base}load:own:{scope}:{client}",
            f"{base}load:own:{scope}:native",
            f"{base}session:{session_id}",
        ]
        args: list[str | int] = [
            self.clock.offset_ms,
            session_id,
            session_tier,
            "1" if filtered else "0",
            lease_ttl_ms,
            lease_id,
            record_ttl_ms,
            client,
            "1" if shared else "0",
            grace_ms,
            record_ttl_ms,
        ]
        return keys, args

    async def _run(self, name: str, keys: Sequence[str], *args: str | int) -> Any:
        keys, argv = self.request(name, keys, *args)
        return await self._scripts[name](keys=keys, args=argv)

    # Placement -------------------------------------------------------------------

    async def place(self, turn: Turn, *, grace_ms: int) -> PlaceResult:
        """The session's recorded sandbox, leased if present with capacity."""
        keys, argv = self.place_request(turn, grace_ms=grace_ms)
        reply = await self._place(keys=keys, args=argv)
        kind = reply[0]
        if kind == b"hit":  # the common answer, decoded here (the client never decodes)
            sandbox_id, tier, expires, endpoint = reply[1:5]
            return Leased(sandbox_id.decode(), tier.decode(), expires, endpoint.decode())
        kind = _s(kind)
        if kind == "first":
            return NoRecord()
        if kind == "busy":
            return Busy(_s(reply[1]), _s(reply[2]), int(reply[3]), int(reply[4]))
        if kind == "pending":
            return Pending(_s(reply[1]), int(reply[2]), int(reply[3]) == 1)
        if kind == "fallback":
            return MustMove(_s(reply[1]), _s(reply[2]))
        raise ValueError(f"place.lua returned {reply!r}")

    async def claim(self, turn: Turn) -> ClaimResult:
        """Compare-and-claim a first turn's sandbox: least loaded in the tier."""
        return _claim_result(await self._run("claim", turn.keys(self.keys), *turn.args()))

    async def replace(self, turn: Turn, *, expected_sandbox_id: str, reason: str) -> ClaimResult:
        """Compare-and-set the session onto the least-loaded sandbox of its tier."""
        reply = await self._run(
            "replace", turn.keys(self.keys), *turn.args(), expected_sandbox_id, reason
        )
        return _claim_result(reply)

    async def release(self, lease_id: str, sandbox_id: str = "", client: str = "") -> bool:
        """Return a lease; False if it was already gone, held on another sandbox, or
        placed for another client than ``client`` ("": whoever it was placed for)."""
        # KEYS are the shared indexes alone; written out, as every turn releases.
        reply = await self._release(
            keys=self._shared, args=(self.clock.offset_ms, lease_id, sandbox_id, client)
        )
        return int(reply) == 1

    async def prepare(
        self, session_id: str, client: str, *, grace_ms: int, mark_ttl_ms: int
    ) -> Prepared:
        """Whether client ``client``'s session ``session_id`` has an absent sandbox to
        wake, taking the absence's wake marker if no one has (SPEC W2)."""
        reply = await self._run(
            "prepare", [self.keys.session(session_id, client)], grace_ms, mark_ttl_ms
        )
        state = _s(reply[0])
        if state == "none":
            return Prepared("none")
        if state in ("running", "moves"):
            return Prepared(state, _s(reply[1]), _s(reply[2]))
        if state == "pending":
            return Prepared(state, _s(reply[1]), _s(reply[2]), int(reply[3]), int(reply[4]) == 1)
        raise ValueError(f"prepare.lua returned {reply!r}")

    # Presence --------------------------------------------------------------------

    async def attach(
        self,
        *,
        sandbox_id: str,
        owner: str,
        tier: str,
        capacity: int,
        labels: Mapping[str, str],
        endpoint: str,
        presence_ttl_ms: int,
        generation: str,
        client: str = "",
        scope: str | None = None,
    ) -> tuple[str, str]:
        """Clear the detach mark, then put presence (``client``: the sandbox's owner
        as attested, "" for none; ``scope``: the owner index it joins, its tier when
        tiers filter and ``*`` when they do not; None: its tier).

        Returns ``("ok", previous owner or "")``, ``("revoked", "")`` when the
        sandbox's credential record does not name ``generation``, or
        ``("taken", owner)`` when ``generation`` is empty (no proof) and another
        stream's presence is live. A refusal writes nothing.
        """
        reply = await self._run(
            "attach",
            [
                *self.keys.worker(sandbox_id),
                self.keys.own_load(tier if scope is None else scope, client),
                self.keys.leases(sandbox_id),
            ],
            sandbox_id,
            owner,
            tier,
            capacity,
            json.dumps(dict(labels), sort_keys=True),
            endpoint,
            presence_ttl_ms,
            generation,
            client,
            tier if scope is None else scope,
        )
        return _s(reply[0]), _s(reply[1])

    async def heartbeat(
        self, *, sandbox_id: str, owner: str, presence_ttl_ms: int, generation: str
    ) -> str:
        """``ok``, ``missing`` (attach again), ``superseded`` (a newer stream owns
        it) or ``revoked`` (the credential record no longer names ``generation``)."""
        k = self.keys
        keys = [k.presence(sandbox_id), k.credential(sandbox_id)]
        return _s(
            await self._run("heartbeat", keys, sandbox_id, owner, presence_ttl_ms, generation)
        )

    async def detach(self, *, sandbox_id: str, owner: str, mark_ttl_ms: int) -> bool:
        """Remove presence, then write the detach mark; False if not this owner's."""
        keys = self.keys.worker(sandbox_id)[:2]
        return int(await self._run("detach", keys, sandbox_id, owner, mark_ttl_ms)) == 1

    # Reads -----------------------------------------------------------------------

    async def session(self, session_id: str, client: str | None) -> SessionRecord | None:
        """Client ``client``'s session record (None: the ownerless record of the id)."""
        reply: Sequence[Any] = await self._run("session", [self.keys.session(session_id, client)])
        if not reply:
            return None
        now_ms, pttl = int(reply[0]), int(reply[1])
        fields = {_s(reply[i]): _s(reply[i + 1]) for i in range(2, len(reply), 2)}
        reset_at = fields.get("reset_at")
        return SessionRecord(
            sandbox_id=fields.get("sandbox", ""),
            tier=fields.get("tier", ""),
            expires_ms=now_ms + max(pttl, 0),
            reset_from=fields.get("reset_from"),
            reset_to=fields.get("reset_to"),
            reset_at_ms=int(reset_at) if reset_at else None,
            reset_reason=fields.get("reset_reason"),
            client=fields.get("client", ""),
        )

    async def workers(self, tier: str | None, client: str | None = None) -> list[WorkerView]:
        """Present workers, least loaded first; ``tier`` None for all of them;
        ``client`` None for every owner's, else only that client's sandboxes."""
        reply: Sequence[Any] = await self._run(
            "workers", [self.keys.load()], tier or "", "\0" if client is None else client
        )
        return [
            WorkerView(
                sandbox_id=_s(reply[i]),
                tier=_s(reply[i + 1]),
                capacity=int(reply[i + 2]),
                leases=int(reply[i + 3]),
                labels=json.loads(_s(reply[i + 4])),
                client=_s(reply[i + 5]),
            )
            for i in range(0, len(reply), 6)
        ]


def _claim_result(reply: Sequence[Any]) -> ClaimResult:
    kind = _s(reply[0])
    if kind in ("first", "fallback"):
        reset_at = int(reply[5]) if kind == "fallback" else None
        return Leased(_s(reply[1]), _s(reply[2]), int(reply[3]), _s(reply[4]), reset_at)
    if kind in ("exists", "changed"):
        return RecordMoved(_s(reply[1]))
    if kind == "exhausted":
        return Exhausted()
    raise ValueError(f"affinity script returned {reply!r}")
