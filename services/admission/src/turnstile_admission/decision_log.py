"""The decision log as data (SPEC Q3, N3): its entries typed, read back in bounded pages.

The log is one Redis stream per bounded key beside the platform's, in admission's
hash slot (``turnstile_platform.decision_log``). ``admit.lua`` appends each
decision to its key's stream itself (``_decision_log.lua``), so an entry exists
exactly when its decision did; the substrate and affinity append their side of
the same calls (``turnstile_platform.decision_log``) with the same fields where
they apply. This module parses entries into :class:`LoggedDecision` and reads
them newest first with XREVRANGE and a COUNT from the :class:`Source` streams a
query needs: one client's read is its key's stream (or its sandbox stream)
alone, so it costs what it returns; an operator's read of every client merges
the streams the log's index lists. Whatever its sources and filters, a read
never scans more than :data:`MAX_SCANNED` entries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import redis.asyncio as aioredis
from prometheus_client import Counter
from redis.exceptions import ResponseError

from turnstile_admission.policies import Mode, PolicyName, Verdict
from turnstile_clientkeys import BoundedKey, KeyKind
from turnstile_platform import decision_log as log_keys
from turnstile_platform.settings import DecisionLogSettings

#: The most entries one read scans (XREVRANGE pages of :data:`_BATCH`), matching
#: or not: a filtered read of a long log returns what it found and a cursor.
MAX_SCANNED = 5_000
_BATCH = 500
#: The most streams an operator's read of every client merges (the log's index
#: lists one per bounded key, bounded by the key set, and the platform's).
MAX_STREAMS = 1_000

ENTRIES_READ = Counter(
    "turnstile_admission_decision_log_entries_read_total",
    "Decision-log entries ListDecisions read from Redis, matching or not, by the kind of "
    "stream: key (a bounded key's), sandbox (a key's sandbox stream), platform, legacy "
    "(the single stream before SPEC N3). A client's read reads its own stream alone.",
    ["stream"],
)

#: The script's words for a verdict (``_decision_log.lua``) as verdicts.
_VERDICTS = {
    "pass": Verdict.PASS,
    "unknown": Verdict.UNKNOWN,
    "skipped": Verdict.SKIPPED,
}


class LoggedVerdict(NamedTuple):
    """One policy's verdict as the log holds it."""

    policy: PolicyName
    mode: Mode
    verdict: Verdict
    limit: int = 0
    current: int = 0
    retry_ms: int = -1
    detail: str = ""


class LoggedShadow(NamedTuple):
    """One shadow limit's verdict as the log holds it (SPEC Q4)."""

    policy: PolicyName
    over: bool
    limit: int
    current: int


class LoggedChange(NamedTuple):
    """What an AdminService call changed (``limits_changed``, ``keys_changed``; SPEC M1)."""

    target: str
    verb: str
    previous: str
    """The document before, as JSON (empty: none was stored)."""
    current: str


@dataclass(frozen=True)
class LoggedDecision:
    """One entry of the decision log."""

    id: str
    at_ms: int
    service: str
    kind: str
    trace_id: str = ""
    sampled: bool = False
    identity: str = ""
    client: str = ""
    sandbox_id: str = ""
    key: str = ""
    key_kind: str = ""
    key_set_version: int = 0
    activation: str = ""
    verdicts: tuple[LoggedVerdict, ...] = ()
    shadow: tuple[LoggedShadow, ...] = ()
    hold_id: str = ""
    hold_expires_ms: int = 0
    node: str = ""
    detail: str = ""
    waited_ms: int | None = None
    """How long the call had waited in the fair queue (None: it did not wait)."""
    change: LoggedChange | None = None
    """Set on the admin API's entries (``turnstile_admission.audit``)."""
    extra: Mapping[str, str] = field(default_factory=dict)
    """Fields this version does not know (a newer writer's)."""

    @property
    def refused_by(self) -> LoggedVerdict | None:
        return next((v for v in self.verdicts if v.verdict is Verdict.REFUSE), None)


_KNOWN = frozenset(
    {
        "at",
        "service",
        "kind",
        "trace",
        "sampled",
        "identity",
        "client",
        "sandbox",
        "key",
        "key_kind",
        "key_set",
        "activation",
        "verdicts",
        "hold",
        "hold_exp",
        "node",
        "detail",
        "wait",
        "target",
        "verb",
        "previous",
        "current",
    }
)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _int(value: str) -> int:
    try:
        return int(float(value)) if value else 0
    except ValueError:
        return 0


def _verdicts(raw: str) -> tuple[tuple[LoggedVerdict, ...], tuple[LoggedShadow, ...]]:
    """The ``verdicts`` field: ``[{p, m, v, l, c, r, d, s?}]`` (``_decision_log.lua``);
    an entry that cannot be read gives no verdicts rather than failing a read."""
    try:
        doc = json.loads(raw) if raw else []
    except ValueError:
        return (), ()
    verdicts: list[LoggedVerdict] = []
    shadow: list[LoggedShadow] = []
    if not isinstance(doc, list):
        return (), ()
    for item in doc:
        if not isinstance(item, dict):
            continue
        try:
            policy = PolicyName(str(item.get("p")))
            mode = Mode(item.get("m", "off"))
        except ValueError:
            continue
        word = item.get("v", "skipped")
        if word == "over":
            verdict = Verdict.REFUSE if mode is Mode.ENFORCE else Verdict.SHADOW_REFUSE
        else:
            verdict = _VERDICTS.get(word, Verdict.SKIPPED)
        detail = item.get("d")
        verdicts.append(
            LoggedVerdict(
                policy,
                mode,
                verdict,
                int(item.get("l") or 0),
                int(item.get("c") or 0),
                int(item.get("r", -1) or 0),
                detail if isinstance(detail, str) else "",
            )
        )
        s = item.get("s")
        if isinstance(s, dict):
            shadow.append(
                LoggedShadow(
                    policy, s.get("v") == "over", int(s.get("l") or 0), int(s.get("c") or 0)
                )
            )
    return tuple(verdicts), tuple(shadow)


def parse_entry(entry_id: bytes | str, fields: Mapping[bytes | str, bytes | str]) -> LoggedDecision:
    """One stream entry as a :class:`LoggedDecision`."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    ident = _text(entry_id)
    verdicts, shadow = _verdicts(f.get("verdicts", ""))
    at = _int(f.get("at", "")) or _int(ident.split("-", 1)[0])
    return LoggedDecision(
        id=ident,
        at_ms=at,
        service=f.get("service", "admission"),
        kind=f.get("kind", ""),
        trace_id=f.get("trace", ""),
        sampled=f.get("sampled") == "1",
        identity=f.get("identity", ""),
        client=f.get("client", ""),
        sandbox_id=f.get("sandbox", ""),
        key=f.get("key", ""),
        key_kind=f.get("key_kind", ""),
        key_set_version=_int(f.get("key_set", "")),
        activation=f.get("activation", ""),
        verdicts=verdicts,
        shadow=shadow,
        hold_id=f.get("hold", ""),
        hold_expires_ms=_int(f.get("hold_exp", "")),
        node=f.get("node", ""),
        detail=f.get("detail", ""),
        waited_ms=_int(f["wait"]) if "wait" in f else None,
        change=(
            LoggedChange(
                f["target"], f.get("verb", ""), f.get("previous", ""), f.get("current", "")
            )
            if "target" in f
            else None
        ),
        extra={k: v for k, v in f.items() if k not in _KNOWN},
    )


@dataclass(frozen=True)
class Query:
    """What to read: every filter optional; ids are stream ids (``<ms>-<seq>``)."""

    client: str = ""
    sandbox_id: str = ""
    since_ms: int = 0
    limit: int = 100
    before: str = ""
    """Only entries older than this id (exclusive)."""
    after: str = ""
    """Only entries newer than this id (exclusive)."""


class Page(NamedTuple):
    decisions: Sequence[LoggedDecision]
    next_before: str
    """Where the next (older) page starts; empty when the log has no more."""
    scanned: int = 0
    """Entries read from Redis for this page, matching or not."""


@dataclass(frozen=True)
class Source:
    """One stream a read takes entries from, and the filters its entries need
    (a key's stream holds that key's entries alone: no client filter)."""

    stream: str
    kind: str
    """``key``, ``sandbox``, ``platform`` or ``legacy`` (:data:`ENTRIES_READ`)."""
    client: str = ""
    sandbox_id: str = ""


class CursorRejectedError(ValueError):
    """Redis refused a cursor the validation let through; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _matches(entry: LoggedDecision, source: Source) -> bool:
    if source.client and entry.client != source.client:
        return False
    return not (source.sandbox_id and entry.sandbox_id != source.sandbox_id)


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return _int(ms), _int(seq)


def _cursor_field(query: Query) -> str:
    return "before" if query.before else "after"


async def _read_one(
    client: aioredis.Redis | aioredis.RedisCluster, source: Source, query: Query, budget: int
) -> tuple[list[LoggedDecision], str, int]:
    """Entries of one source matching its filters, newest first, at most
    ``query.limit``, scanning at most ``budget``: (entries, where this source's
    unread part starts or "" when it has none, entries scanned)."""
    high = f"({query.before}" if query.before else "+"
    low = f"({query.after}" if query.after else (f"{query.since_ms}" if query.since_ms else "-")
    if query.after and query.since_ms and _int(query.after.split("-", 1)[0]) < query.since_ms:
        low = f"{query.since_ms}"
    filtered = bool(source.client or source.sandbox_id)
    found: list[LoggedDecision] = []
    scanned = 0
    while scanned < budget:
        count = min(_BATCH, budget - scanned, _BATCH if filtered else query.limit - len(found))
        try:
            batch = await client.xrevrange(source.stream, max=high, min=low, count=count) or []
        except ResponseError as error:
            raise CursorRejectedError(_cursor_field(query), str(error)) from error
        for entry_id, fields in batch:
            scanned += 1
            entry = parse_entry(entry_id or "", fields or {})
            if _matches(entry, source):
                found.append(entry)
                if len(found) >= query.limit:
                    return found, entry.id, scanned
        if len(batch) < count:
            return found, "", scanned
        high = f"({_text(batch[-1][0] or '')}"
    return found, high[1:] if high != "+" else "", scanned


async def read(
    client: aioredis.Redis | aioredis.RedisCluster,
    sources: Sequence[Source],
    query: Query,
    max_scanned: int = MAX_SCANNED,
) -> Page:
    """Entries of ``sources`` matching ``query``, newest first, at most
    ``query.limit`` (more only to keep entries of one id together); scans at most
    ``max_scanned`` entries in all (then answers with what it found and a cursor
    to go on from).

    Several sources are merged by id: each is read within its share of the
    scan bound, and only entries at or after the latest point where a source
    stopped short are certain to be complete, so the page ends there and its
    cursor names that point (the last entry returned, or the last one read)."""
    if not sources:
        return Page((), "")
    budget = max(1, max_scanned // len(sources))
    found: list[LoggedDecision] = []
    stops: list[tuple[int, int]] = []
    cursors: dict[tuple[int, int], str] = {}
    scanned = 0
    for source in sources:
        entries, stop, n = await _read_one(client, source, query, budget)
        ENTRIES_READ.labels(source.kind).inc(n)
        scanned += n
        found += entries
        if stop:
            stops.append(_order(stop))
            cursors[stops[-1]] = stop
    found.sort(key=lambda e: _order(e.id), reverse=True)
    boundary = max(stops, default=None)
    if boundary is not None:
        found = [e for e in found if _order(e.id) >= boundary]
    if len(found) > query.limit:
        cut = query.limit
        last = _order(found[cut - 1].id)
        while cut < len(found) and _order(found[cut].id) == last:
            cut += 1
        return Page(found[:cut], found[cut - 1].id, scanned)
    return Page(found, cursors[boundary] if boundary is not None else "", scanned)


def client_sources(
    prefix: str, settings: DecisionLogSettings, query: Query, key: BoundedKey
) -> list[Source]:
    """What one client's read takes entries from: its bounded key's stream, or with
    a sandbox filter that sandbox's stream of the key, alone (the shared key's
    stream holds every client without a key of its own, so it is filtered by
    client); and the single stream before SPEC N3 while it is read."""
    stream = log_keys.key_stream(prefix, key.key)
    client = query.client if key.kind is KeyKind.SHARED else ""
    sources = [_of_stream(stream, "key", settings, query, client)]
    return sources + _legacy(prefix, settings, query)


def all_sources(
    prefix: str, settings: DecisionLogSettings, query: Query, streams: Sequence[str]
) -> list[Source]:
    """What an operator's read of every client merges: each stream the log's index
    lists (every key's and the platform's), and the legacy stream while read."""
    platform = log_keys.platform_stream(prefix)
    sources = [
        _of_stream(s, "platform" if s == platform else "key", settings, query, "") for s in streams
    ]
    return sources + _legacy(prefix, settings, query)


def _of_stream(
    stream: str, kind: str, settings: DecisionLogSettings, query: Query, client: str
) -> Source:
    if query.sandbox_id and kind == "key" and settings.sandbox_max_entries > 0:
        return Source(log_keys.sandbox_stream(stream, query.sandbox_id), "sandbox", client)
    return Source(stream, kind, client, query.sandbox_id)


def _legacy(prefix: str, settings: DecisionLogSettings, query: Query) -> list[Source]:
    if not settings.read_legacy:
        return []
    return [Source(log_keys.decisions_key(prefix), "legacy", query.client, query.sandbox_id)]
