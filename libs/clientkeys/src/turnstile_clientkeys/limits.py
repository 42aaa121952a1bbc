"""Per-key limits, stored in Redis and changed without a restart.

The limits hash (:func:`limits_key`, admission's ``AdmissionKeys.limits``) holds
small JSON documents: ``default`` (overrides the settings' defaults for every
key), ``cluster`` (the cluster bucket) and ``key:<bounded key>`` (one key's own
limits). Admission's ``admit.lua`` reads them itself with one HMGET, so a change
applies to the very next decision on every replica, with no reload to
propagate. Fields left out fall back to the next level: key → stored default →
settings.

They live beside the key set, in this library, because both admission and
``turnstilectl limits`` read and change them and neither may import the other.
Changes go through admission's AdminService (SPEC M1), which validates them
here (:meth:`Limits.parse`, each error naming its field) and writes them with
:meth:`LimitsStore.change`; the script also ignores a malformed value rather
than fail a decision.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from turnstile_clientkeys.labels import is_label_value

#: The fair queue's priority levels (SPEC Q2), a fixed set: a key's ``level``
#: names one; admission's settings give each its guaranteed share.
LEVELS = ("platform", "interactive", "batch")


#: The largest value of any limit: what admission's settings allow for their defaults.
MAX_LIMIT = 1_000_000

#: How often :meth:`LimitsStore.change` retries a transaction another writer raced.
CHANGE_ATTEMPTS = 64


class LimitsError(ValueError):
    """A limits change that cannot be stored; ``field`` names the limit at fault
    (``shadow.cap``; empty: the document as a whole)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.description = message


class LimitsConflictError(RuntimeError):
    """Other writers changed the limits hash :data:`CHANGE_ATTEMPTS` times in a row."""


@dataclass(frozen=True)
class Limits:
    """Limits of one bounded key (or the stored defaults); None means "inherit".

    ``shadow`` (SPEC Q4) holds limits under test beside the enforced ones (e.g. a
    cap of 5 while 10 is enforced): each decision reports and counts their
    verdicts, and they never refuse."""

    cap: int | None = None
    rate: float | None = None
    burst: float | None = None
    concurrency: int | None = None
    #: The key's weight in admission's fair queue (SPEC Q1): its share of the
    #: cluster bucket while keys wait, relative to the others' (default 1).
    weight: float | None = None
    #: The key's priority level in the fair queue (SPEC Q2), one of :data:`LEVELS`.
    level: str | None = None
    shadow: Limits | None = None

    def to_json(self) -> str:
        return json.dumps(self.as_dict())

    @classmethod
    def parse(cls, doc: Any, *, shadow_allowed: bool = True) -> Limits:
        if not isinstance(doc, dict):
            raise LimitsError("limits must be a JSON object")
        names = {"cap", "rate", "burst", "concurrency", "weight", "level"}
        if shadow_allowed:
            names.add("shadow")
        unknown = set(doc) - names
        if unknown:
            first = sorted(unknown)[0]
            raise LimitsError(f"unknown limits: {', '.join(sorted(unknown))}", first)
        shadow = None
        if doc.get("shadow") is not None:
            try:
                shadow = cls.parse(doc["shadow"], shadow_allowed=False)
                if shadow.weight is not None or shadow.level is not None:
                    # It shadows the enforced limits (SPEC Q4), not the fair
                    # queue's weight or level (SPEC Q1, Q2).
                    raise LimitsError(
                        "no weight or level", "weight" if shadow.weight is not None else "level"
                    )
            except LimitsError as error:
                raise LimitsError(
                    f"shadow: {error}", f"shadow.{error.field}" if error.field else "shadow"
                ) from error
        return cls(
            cap=_integer(doc, "cap"),
            rate=_number(doc, "rate", above_zero=True),
            burst=_number(doc, "burst", minimum=1),
            concurrency=_integer(doc, "concurrency"),
            weight=_number(doc, "weight", above_zero=True),
            level=_level(doc),
            shadow=shadow,
        )

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: v for k, v in asdict(self).items() if v is not None and k != "shadow"
        }
        if self.shadow is not None:
            out["shadow"] = self.shadow.as_dict()
        return out


@dataclass(frozen=True)
class ClusterLimits:
    rate: float | None = None
    burst: float | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, doc: Any) -> ClusterLimits:
        limits = Limits.parse(doc, shadow_allowed=False)
        for name in ("cap", "concurrency", "weight", "level"):
            if getattr(limits, name) is not None:
                raise LimitsError("the cluster has only rate and burst", name)
        return cls(rate=limits.rate, burst=limits.burst)


def limits_key(prefix: str) -> str:
    """The limits hash, in admission's hash slot (``<prefix>{adm}:limits``)."""
    return f"{prefix}{{adm}}:limits"


#: The hash fields of the two documents that are not a key's.
DEFAULT, CLUSTER = "default", "cluster"


def merge_patch(current: dict[str, Any], patch: Any) -> dict[str, Any]:
    """``current`` with ``patch`` merged in (RFC 7386: a ``null`` removes a field)."""
    if not isinstance(patch, dict):
        raise LimitsError("limits must be a JSON object")
    merged = dict(current)
    for name, value in patch.items():
        if value is None:
            merged.pop(name, None)
        else:
            merged[name] = value
    return merged


def _number(
    doc: dict[str, Any], name: str, *, minimum: float = 0, above_zero: bool = False
) -> float | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LimitsError(f"{name} must be a finite number", name)
    if above_zero and value <= 0:
        raise LimitsError(f"{name} must be greater than 0", name)
    if value < minimum:
        raise LimitsError(
            f"{name} must be at least {minimum:g}" if minimum else f"{name} must not be negative",
            name,
        )
    if value > MAX_LIMIT:
        raise LimitsError(f"{name} must be at most {MAX_LIMIT}", name)
    return float(value)


def _level(doc: dict[str, Any]) -> str | None:
    value = doc.get("level")
    if value is None:
        return None
    if value not in LEVELS:
        raise LimitsError(f"level must be one of {', '.join(LEVELS)}", "level")
    return str(value)


def _integer(doc: dict[str, Any], name: str) -> int | None:
    value = _number(doc, name)
    if value is None:
        return None
    if not value.is_integer():
        raise LimitsError(f"{name} must be a whole number", name)
    return int(value)


class LimitsStore:
    """Reads and changes the limits hash (the admin path).

    ``field`` is ``key:<bounded key>``, :data:`DEFAULT` or :data:`CLUSTER`
    (:meth:`field_of` builds one); each document is validated before it is
    written."""

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, prefix: str) -> None:
        self._redis = client
        self.hash = limits_key(prefix)

    @staticmethod
    def field_of(key: str) -> str:
        if not is_label_value(key):
            raise LimitsError(f"{key!r} is not a bounded key")
        return f"key:{key}"

    async def get(self, field: str) -> dict[str, Any] | None:
        """The stored document (None: none, the next level applies)."""
        raw = await self._redis.hget(self.hash, field)
        return None if raw is None else dict(json.loads(raw))

    async def put(self, field: str, doc: Any) -> dict[str, Any]:
        """Replace the document with ``doc`` (validated); the document stored."""
        stored = (ClusterLimits if field == CLUSTER else Limits).parse(doc).as_dict()
        await self._redis.hset(self.hash, field, json.dumps(stored))
        return stored

    async def change(
        self, field: str, apply: Callable[[dict[str, Any] | None], dict[str, Any] | None]
    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Replace ``field``'s document with ``apply(current)`` (None: delete it) in
        one optimistic transaction; the documents before and after.

        ``apply`` validates (raising :class:`LimitsError` changes nothing) and may
        run more than once: a writer that raced this one makes it start again, at
        most :data:`CHANGE_ATTEMPTS` times (then :class:`LimitsConflictError`). So two
        concurrent patches of one document never lose each other's fields."""
        for _ in range(CHANGE_ATTEMPTS):
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self.hash)
                    raw = await pipe.hget(self.hash, field)
                    before = None if raw is None else dict(json.loads(raw))
                    after = apply(before)
                    pipe.multi()  # type: ignore[no-untyped-call]
                    if after is None:
                        pipe.hdel(self.hash, field)
                    else:
                        pipe.hset(self.hash, field, json.dumps(after, sort_keys=True))
                    await pipe.execute()
                except WatchError:
                    continue
            return before, after
        raise LimitsConflictError(
            f"{field}: changed by other writers {CHANGE_ATTEMPTS} times in a row"
        )

    async def delete(self, field: str) -> bool:
        return bool(await self._redis.hdel(self.hash, field))

    async def set_key(self, key: str, limits: Limits) -> None:
        await self._redis.hset(self.hash, self.field_of(key), limits.to_json())

    async def clear_key(self, key: str) -> bool:
        return bool(await self._redis.hdel(self.hash, f"key:{key}"))

    async def set_default(self, limits: Limits) -> None:
        await self._redis.hset(self.hash, DEFAULT, limits.to_json())

    async def set_cluster(self, limits: ClusterLimits) -> None:
        if limits.rate is not None and limits.rate <= 0:
            raise LimitsError("rate must be greater than 0")
        if limits.burst is not None and limits.burst < 1:
            raise LimitsError("burst must be at least 1")
        await self._redis.hset(self.hash, CLUSTER, limits.to_json())

    async def show(self) -> dict[str, Any]:
        raw = await self._redis.hgetall(self.hash)
        return {_text(k): json.loads(v) for k, v in sorted(raw.items())}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
