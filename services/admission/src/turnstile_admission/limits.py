"""Per-key limits, stored in Redis and changed without a restart.

The limits hash (:attr:`AdmissionKeys.limits`) holds small JSON documents:
``default`` (overrides the settings' defaults for every key), ``cluster`` (the
cluster bucket) and ``key:<bounded key>`` (one key's own limits). ``admit.lua``
reads them itself with one HMGET, so a change applies to the very next decision
on every replica, with no reload to propagate. Fields left out fall back to the
next level: key → stored default → settings.

Changes go through :class:`LimitsStore` (and the ``turnstile-admission-limits``
command), which validates them; the script also ignores a malformed value rather
than fail a decision.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis

from turnstile_admission.keys import AdmissionKeys
from turnstile_clientkeys import is_label_value


class LimitsError(ValueError):
    """A limits change that cannot be stored."""


@dataclass(frozen=True)
class Limits:
    """Limits of one bounded key (or the stored defaults); None means "inherit"."""

    cap: int | None = None
    rate: float | None = None
    burst: float | None = None
    concurrency: int | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})

    @classmethod
    def parse(cls, doc: Any) -> Limits:
        if not isinstance(doc, dict):
            raise LimitsError("limits must be a JSON object")
        unknown = set(doc) - {"cap", "rate", "burst", "concurrency"}
        if unknown:
            raise LimitsError(f"unknown limits: {', '.join(sorted(unknown))}")
        limits = cls(
            cap=_integer(doc, "cap"),
            rate=_number(doc, "rate"),
            burst=_number(doc, "burst"),
            concurrency=_integer(doc, "concurrency"),
        )
        if limits.rate is not None and limits.rate <= 0:
            raise LimitsError("rate must be greater than 0")
        if limits.burst is not None and limits.burst < 1:
            raise LimitsError("burst must be at least 1")
        return limits


@dataclass(frozen=True)
class ClusterLimits:
    rate: float | None = None
    burst: float | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})


def _number(doc: dict[str, Any], name: str) -> float | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LimitsError(f"{name} must be a finite number")
    if value < 0:
        raise LimitsError(f"{name} must not be negative")
    return float(value)


def _integer(doc: dict[str, Any], name: str) -> int | None:
    value = _number(doc, name)
    if value is None:
        return None
    if not value.is_integer():
        raise LimitsError(f"{name} must be a whole number")
    return int(value)


class LimitsStore:
    """Reads and changes the limits hash (the admin path)."""

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, keys: AdmissionKeys) -> None:
        self._redis = client
        self._keys = keys

    async def set_key(self, key: str, limits: Limits) -> None:
        if not is_label_value(key):
            raise LimitsError(f"{key!r} is not a bounded key")
        await self._redis.hset(self._keys.limits, f"key:{key}", limits.to_json())

    async def clear_key(self, key: str) -> bool:
        return bool(await self._redis.hdel(self._keys.limits, f"key:{key}"))

    async def set_default(self, limits: Limits) -> None:
        await self._redis.hset(self._keys.limits, "default", limits.to_json())

    async def set_cluster(self, limits: ClusterLimits) -> None:
        if limits.rate is not None and limits.rate <= 0:
            raise LimitsError("rate must be greater than 0")
        if limits.burst is not None and limits.burst < 1:
            raise LimitsError("burst must be at least 1")
        await self._redis.hset(self._keys.limits, "cluster", limits.to_json())

    async def show(self) -> dict[str, Any]:
        raw = await self._redis.hgetall(self._keys.limits)
        return {_text(k): json.loads(v) for k, v in sorted(raw.items())}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
