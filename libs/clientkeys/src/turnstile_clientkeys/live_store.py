"""The writes to the live counts admission reads (SPEC S4), beside their key
layout (:mod:`turnstile_clientkeys.live_counts`) so admission's tests run the
real script without importing the substrate.

Only the substrate's leader-only work writes here: the Kubernetes substrate's
``LivePublisher`` and the Direct substrate's declaration that it cannot count.
Every write is ``live_publish.lua``, fenced by the writer's leader epoch: a write
from an epoch older than the newest one seen raises :class:`FencedError` and
changes nothing. The script declares every key it touches in ``KEYS``; all carry
admission's hash tag, so it runs on one slot of a Redis Cluster.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from turnstile_clientkeys.live_counts import LiveCountKeys


def script_text() -> str:
    """``live_publish.lua``, shipped beside this module."""
    return resources.files("turnstile_clientkeys").joinpath("live_publish.lua").read_text("utf-8")


class FencedError(RuntimeError):
    """A newer leader has written: this one must stop writing."""


class StateLostError(RuntimeError):
    """Redis no longer has the writer's epoch (restarted without its data, or failed
    over to a replica that lacked it): what the writer published may be gone, and it
    must read what is there and resync before marking the counts current."""


class Op(enum.StrEnum):
    SET = "set"
    """The sandbox is live under the key (moved out of the key's pending set)."""
    DEL = "del"
    """The sandbox is no longer live under the key."""


@dataclass(frozen=True)
class Change:
    op: Op
    sandbox_id: str
    key: str


#: ``state`` arguments of :meth:`LiveStore.write` besides a marker value.
KEEP, DROP = "", "-"


class LiveStore:
    def __init__(
        self, client: aioredis.Redis | aioredis.RedisCluster, prefix: str, *, state_ttl_s: float
    ) -> None:
        self.redis = client
        self.keys = LiveCountKeys(prefix)
        self.state_ttl_ms = max(1, round(state_ttl_s * 1000))
        self._script: AsyncScript = client.register_script(script_text())

    async def write(
        self,
        epoch: int,
        changes: Sequence[Change] = (),
        state: str = KEEP,
        *,
        continuing: bool = False,
    ) -> int:
        """Apply ``changes`` and the marker ``state`` in one fenced script; the ids
        added or removed. ``state``: :data:`KEEP`, :data:`DROP` or a marker value.
        ``continuing``: this writer has written in this epoch before, so Redis must
        still have the epoch (else :class:`StateLostError`, nothing applied)."""
        k = self.keys
        keys = [k.epoch, k.sandboxes, k.state]
        args: list[str | int] = [epoch, state, self.state_ttl_ms, int(continuing)]
        for change in changes:
            keys.append(k.live(change.key))
            if change.op is Op.SET:
                keys.append(k.pending(change.key))
            args += [change.op.value, change.sandbox_id, change.key]
        applied, value = await self._script(keys=keys, args=args)
        if int(applied) == 2:
            raise StateLostError(f"Redis lost the live counts of epoch {epoch}")
        if not int(applied):
            raise FencedError(f"epoch {epoch} is older than {int(value)}: another leader writes")
        return int(value)

    async def published(self, page_size: int) -> dict[str, str]:
        """Every published sandbox id with its key, read page by page (HSCAN), so a
        large cluster never blocks Redis."""
        found: dict[str, str] = {}
        cursor = 0
        while True:
            cursor, page = await self.redis.hscan(self.keys.sandboxes, cursor, count=page_size)
            assert isinstance(page, dict)  # HSCAN without NOVALUES: field → value
            for sandbox, key in page.items():
                found[_s(sandbox)] = _s(key)
            if cursor == 0:
                return found


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
