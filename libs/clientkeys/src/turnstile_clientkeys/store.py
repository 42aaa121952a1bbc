"""The key set's source of truth in Redis, and the watcher that keeps each
replica's resolver current.

Propagation has two paths, so a change reaches every replica within about a
second (SPEC C2): a pub/sub message on every change (fast path), and a periodic
version check (safety net for a dropped subscription or a missed message).
The stored document is bootstrapped from settings when Redis has none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from turnstile_clientkeys.keyset import KeySet
from turnstile_clientkeys.resolver import Resolver

log = logging.getLogger(__name__)

_LISTEN_TICK_S = 0.25

#: How often :meth:`KeySetStore.update` retries a transaction another writer raced.
CHANGE_ATTEMPTS = 64


class KeySetConflictError(RuntimeError):
    """Other writers changed the key set :data:`CHANGE_ATTEMPTS` times in a row."""


class KeySetStore:
    """Reads and changes the key set under ``{prefix}{keyset}``.

    The document and its version share the hash tag ``{keyset}``, so the
    transactions that write both (``MULTI``) stay in one slot of a Redis Cluster.
    """

    def __init__(self, client: aioredis.Redis | aioredis.RedisCluster, prefix: str) -> None:
        self._redis = client
        self.doc_key = f"{prefix}{{keyset}}"
        self.version_key = f"{prefix}{{keyset}}:version"
        self.channel = f"{prefix}keyset:changed"
        #: Where the document lived before it had a hash tag; read once, at bootstrap.
        self.legacy_doc_key = f"{prefix}keyset"

    async def bootstrap(self, initial: KeySet) -> KeySet:
        """Store ``initial`` (at version 1) unless a key set exists; return the stored one.

        A key set stored under the untagged name of earlier releases is carried over
        (with its version) rather than replaced by ``initial``: an upgrade keeps the
        allowlist operators changed at run time."""
        legacy = await self._redis.get(self.legacy_doc_key)
        if legacy is not None:
            initial = KeySet.from_json(legacy)
        seed = KeySet(
            version=max(1, initial.version), allowlist=initial.allowlist, flags=initial.flags
        )
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self.doc_key, seed.to_json(), nx=True)
            pipe.set(self.version_key, seed.version, nx=True)
            await pipe.execute()
        return await self.load()

    async def version(self) -> int | None:
        raw = await self._redis.get(self.version_key)
        return int(raw) if raw is not None else None

    async def load(self) -> KeySet:
        raw = await self._redis.get(self.doc_key)
        return KeySet.from_json(raw) if raw is not None else KeySet()

    async def change(
        self,
        *,
        allow: tuple[str, ...] = (),
        remove: tuple[str, ...] = (),
        flags: Mapping[str, bool] | None = None,
    ) -> KeySet:
        """Apply a change atomically and announce it (:meth:`update`); the new key set."""
        _, updated = await self.update(allow=allow, remove=remove, flags=flags)
        return updated

    async def update(
        self,
        *,
        allow: tuple[str, ...] = (),
        remove: tuple[str, ...] = (),
        flags: Mapping[str, bool] | None = None,
    ) -> tuple[KeySet, KeySet]:
        """Apply a change atomically (optimistic transaction) and announce it; the key
        set before and after. A writer that raced this one makes it start again, at
        most :data:`CHANGE_ATTEMPTS` times (then :class:`KeySetConflictError`).

        The announcement follows the transaction rather than riding in it: a
        cluster client refuses PUBLISH inside a pipeline, and a message lost to a
        crash between the two is what the watchers' version check is for."""
        for _ in range(CHANGE_ATTEMPTS):
            async with self._redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self.doc_key)
                    raw = await pipe.get(self.doc_key)
                    current = KeySet.from_json(raw) if raw is not None else KeySet()
                    updated = current.changed(allow=allow, remove=remove, flags=flags)
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.set(self.doc_key, updated.to_json())
                    pipe.set(self.version_key, updated.version)
                    await pipe.execute()
                except WatchError:
                    continue
            await self._redis.publish(self.channel, updated.version)
            log.info("key set changed", extra={"version": updated.version})
            return current, updated
        raise KeySetConflictError(f"the key set changed {CHANGE_ATTEMPTS} times in a row meanwhile")


class KeySetWatcher:
    """Keeps a :class:`Resolver` on the newest stored key set.

    Its two loops (pub/sub and a version poll) run on **every replica**. They are
    held here and awaited by :meth:`stop`, and catch and log their own failures: this
    library sits below ``turnstile_platform`` (which imports it), so it cannot use the
    platform's ``BackgroundTasks``.
    """

    def __init__(
        self,
        store: KeySetStore,
        client: aioredis.Redis | aioredis.RedisCluster,
        resolver: Resolver,
        *,
        poll_interval_s: float = 0.5,
    ) -> None:
        self.store = store
        self.resolver = resolver
        self._redis = client
        self._poll_interval_s = poll_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        #: Set, then replaced, at each install: wakes every waiter without a task.
        self._installed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._listeners: list[Callable[[KeySet], None]] = []

    def add_listener(self, listener: Callable[[KeySet], None]) -> None:
        """Call ``listener`` with every key set installed from now on (e.g. to drop
        per-key metrics of keys that left the set); it must not block."""
        self._listeners.append(listener)

    async def start(self, initial: KeySet) -> None:
        """Bootstrap, install the stored key set, and start both propagation paths."""
        self._install(await self.store.bootstrap(initial))
        self._tasks = [
            asyncio.create_task(self._listen(), name="keyset-pubsub"),
            asyncio.create_task(self._poll(), name="keyset-poll"),
        ]

    async def stop(self) -> None:
        """Stop both paths; returns within about a quarter of a second."""
        self._stopping.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def refresh(self) -> None:
        """Reload when the stored version differs from the installed one."""
        version = await self.store.version()
        if version is not None and version != self.resolver.version:
            self._install(await self.store.load())

    async def wait_for_version(self, version: int) -> KeySet:
        """Wait until a key set at ``version`` or newer is installed."""
        while self.resolver.version < version:
            await self._installed.wait()
        return self.resolver.keyset

    def _install(self, keyset: KeySet) -> None:
        if keyset.version != self.resolver.version or keyset != self.resolver.keyset:
            self.resolver.swap(keyset)
            log.info("key set installed", extra={"version": keyset.version})
            for listener in self._listeners:
                try:
                    listener(keyset)
                except Exception:
                    log.exception("key-set listener failed")
            self._installed.set()
            self._installed = asyncio.Event()

    async def _listen(self) -> None:
        # get_message with a timeout, not listen(): cancelling a pub/sub read that
        # is parked inside listen() can leave aclose() waiting on the connection.
        while not self._stopping.is_set():
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.store.channel)
                await self.refresh()  # a change may have landed before the subscription
                while not self._stopping.is_set():
                    message = await pubsub.get_message(timeout=_LISTEN_TICK_S)
                    if message is not None:
                        await self.refresh()
            except Exception:
                log.warning("key-set subscription lost; retrying", exc_info=True)
                await self._pause()
            finally:
                await pubsub.aclose()

    async def _pause(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), self._poll_interval_s)

    async def _poll(self) -> None:
        while not self._stopping.is_set():
            await self._pause()
            try:
                await self.refresh()
            except Exception:
                log.warning("key-set version check failed", exc_info=True)


async def watch_keyset(
    client: aioredis.Redis | aioredis.RedisCluster,
    prefix: str,
    resolver: Resolver,
    *,
    allowlist: Iterable[str] = (),
    poll_interval_s: float = 0.5,
) -> KeySetWatcher:
    """Keep ``resolver`` on the stored key set, seeding it with ``allowlist`` when
    Redis has none: what every service does at start. Stop the watcher at shutdown."""
    watcher = KeySetWatcher(
        KeySetStore(client, prefix), client, resolver, poll_interval_s=poll_interval_s
    )
    await watcher.start(KeySet(allowlist=frozenset(allowlist)))
    return watcher
