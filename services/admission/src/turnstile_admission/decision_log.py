"""The decision log as data (SPEC Q3): its entries typed, read back in bounded pages.

The log is one Redis stream in admission's hash slot (``AdmissionKeys.decisions``).
``admit.lua`` appends each decision itself (``_decision_log.lua``), so an entry
exists exactly when its decision did; the substrate and affinity append their
side of the same calls (``turnstile_clientkeys.decision_log``) with the same
fields where they apply. This module parses entries into :class:`LoggedDecision`
and reads them newest first with XREVRANGE and a COUNT: a read never scans more
than :data:`MAX_SCANNED` entries, whatever its filters.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import redis.asyncio as aioredis

from turnstile_admission.policies import Mode, PolicyName, Verdict

#: The most entries one read scans (XREVRANGE pages of :data:`_BATCH`), matching
#: or not: a filtered read of a long log returns what it found and a cursor.
MAX_SCANNED = 5_000
_BATCH = 500

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


def _matches(entry: LoggedDecision, query: Query) -> bool:
    if query.client and entry.client != query.client:
        return False
    return not (query.sandbox_id and entry.sandbox_id != query.sandbox_id)


async def read(client: aioredis.Redis | aioredis.RedisCluster, stream: str, query: Query) -> Page:
    """Entries of ``stream`` matching ``query``, newest first, at most
    ``query.limit``; scans at most :data:`MAX_SCANNED` entries (then answers with
    what it found and a cursor to go on from)."""
    high = f"({query.before}" if query.before else "+"
    low = f"({query.after}" if query.after else (f"{query.since_ms}" if query.since_ms else "-")
    if query.after and query.since_ms and _int(query.after.split("-", 1)[0]) < query.since_ms:
        low = f"{query.since_ms}"
    found: list[LoggedDecision] = []
    scanned = 0
    while scanned < MAX_SCANNED:
        batch = await client.xrevrange(stream, max=high, min=low, count=_BATCH)
        if not batch:
            return Page(found, "")
        for entry_id, fields in batch:
            scanned += 1
            entry = parse_entry(entry_id or "", fields or {})
            if _matches(entry, query):
                found.append(entry)
                if len(found) >= query.limit:
                    return Page(found, entry.id)
        last = _text(batch[-1][0] or "")
        if len(batch) < _BATCH:
            return Page(found, "")
        high = f"({last}"
    return Page(found, high[1:])
