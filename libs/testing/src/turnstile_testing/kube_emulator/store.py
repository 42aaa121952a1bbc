"""The emulator's etcd + watch cache: pods, one resourceVersion counter, and the event history.

Design choices, each for a reason:

* **Stored objects are immutable.** Every write stores a new dict together with its compact JSON
  encoding, so a list of 50,000 pods is a ``b",".join`` of cached bytes and a watch event is one
  concatenation; readers that need a mutable copy decode the bytes (a cheap deep copy).
* **One global counter** gives every write the next resourceVersion, as etcd's revision does; a
  write that changes nothing is skipped (no new version, no event), as ``GuaranteedUpdate`` does.
* **History is a list of events with contiguous versions.** A watch from version ``v`` replays the
  events after ``v``; a list at an older version (``resourceVersionMatch=Exact`` or a ``continue``
  token) is rebuilt by undoing the events after it. Both fail with 410 ``Expired`` once the events
  they need were compacted, which is how clients learn they must re-list.
* **Watchers are subscriptions with their own queue**, filled synchronously by each write, so
  ordering is total and no event is lost between "replay history" and "go live".
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import json
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from turnstile_testing.kube_emulator import pods as pod_rules
from turnstile_testing.kube_emulator.errors import (
    ApiError,
    already_exists,
    bad_request,
    conflict,
    expired,
    not_found,
    too_old_watch,
)
from turnstile_testing.kube_emulator.selectors import PodFilter

Key = tuple[str, str]
"""``(namespace, name)``; sorting keys sorts like etcd's ``/registry/pods/<ns>/<name>``."""

ADDED: Final = "ADDED"
MODIFIED: Final = "MODIFIED"
DELETED: Final = "DELETED"

_SNAPSHOT_CACHE_SIZE = 4
_CONTINUE_EXPIRED = (
    "The provided continue parameter is too old to display a consistent list result. You can "
    "start a new list without the continue parameter, or use the continue token in this response "
    "to retrieve the remainder of the results. Continuing with the provided token results in an "
    "inconsistent list - objects that were created, modified, or deleted between the time the "
    "first chunk was returned and now may show up in the list."
)


def encode(obj: Any) -> bytes:
    """Compact JSON, the wire form of every object the emulator sends."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def now_rfc3339() -> str:
    """Seconds-precision UTC timestamp, the format of ``metav1.Time``."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class StoredPod:
    """An immutable stored pod: the dict (never mutated) and its JSON encoding."""

    obj: dict[str, Any]
    raw: bytes

    @classmethod
    def of(cls, obj: dict[str, Any]) -> StoredPod:
        """Freeze ``obj`` (the caller must not mutate it afterwards)."""
        return cls(obj, encode(obj))

    @property
    def key(self) -> Key:
        """The pod's ``(namespace, name)``."""
        meta = self.obj["metadata"]
        return (meta["namespace"], meta["name"])

    @property
    def resource_version(self) -> int:
        """The version of the write that produced this state."""
        return int(self.obj["metadata"]["resourceVersion"])

    def thaw(self) -> dict[str, Any]:
        """A private, mutable deep copy."""
        copied: dict[str, Any] = json.loads(self.raw)
        return copied

    def restamped(self, resource_version: int) -> StoredPod:
        """The same object carrying another resourceVersion (for DELETED events)."""
        obj = self.thaw()
        obj["metadata"]["resourceVersion"] = str(resource_version)
        return StoredPod.of(obj)


@dataclass(frozen=True, slots=True)
class Event:
    """One committed write. ``pod`` is the new state (for DELETED: the last state stamped with
    the deletion version, as etcd returns it); ``prev`` the state before, if any."""

    rv: int
    type: str
    pod: StoredPod
    prev: StoredPod | None
    #: True for the ADDED events a watch without a resourceVersion starts with.
    synthetic: bool = False


class Control:
    """Out-of-band messages to a watch stream (graceful end or abrupt cut)."""

    END: Final[str] = "end"
    CUT: Final[str] = "cut"


@dataclass(eq=False)
class Subscription:
    """A live watch: its filter, its queue of events, and the version it started after."""

    filter: PodFilter
    start_rv: int
    queue: asyncio.Queue[Event | str] = field(default_factory=asyncio.Queue)
    #: Highest version whose events were all taken off the queue (for safe BOOKMARKs).
    consumed_rv: int = 0


@dataclass(frozen=True, slots=True)
class ListPage:
    """A list response: the version it reflects, the encoded items, and pagination fields."""

    resource_version: int
    items: list[bytes]
    continue_token: str | None = None
    remaining: int | None = None


@dataclass(slots=True)
class _Snapshot:
    keys: list[Key]
    pods: list[StoredPod]


def _encode_continue(rv: int, last: Key) -> str:
    token = {"v": "meta.k8s.io/v1", "rv": rv, "start": f"{last[0]}/{last[1]}\x00"}
    return base64.urlsafe_b64encode(encode(token)).decode()


def _decode_continue(token: str) -> tuple[int, Key]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        rv = int(data["rv"])
        namespace, _, name = str(data["start"]).rstrip("\x00").partition("/")
    except (ValueError, KeyError, TypeError):
        raise bad_request("continue key is not valid: incorrect encoded start key") from None
    return rv, (namespace, name)


def _removable(meta: dict[str, Any]) -> bool:
    """A pod marked for deletion goes once no finalizer holds it and its grace is over."""
    return (
        bool(meta.get("deletionTimestamp"))
        and not meta.get("finalizers")
        and not meta.get("deletionGracePeriodSeconds")
    )


def _parse_rv(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        parsed = int(value)
    except ValueError:
        raise bad_request(f"invalid resource version: {value}") from None
    if parsed < 0:
        raise bad_request(f"invalid resource version: {value}")
    return parsed


class PodStore:
    """All pods, their history, and the live watch subscriptions."""

    def __init__(
        self, history_limit: int | None = 100_000, *, graceful_deletion: bool = False
    ) -> None:
        #: DELETE of a scheduled, unfinished pod marks it Terminating for its grace period
        #: (:meth:`finish_termination` removes it), as the real registry does; False removes
        #: every pod at once (the emulator's original behaviour, which many tests rely on).
        self.graceful_deletion = graceful_deletion
        self._version_waiters: list[tuple[int, asyncio.Future[None]]] = []
        #: Set when a request starts waiting for a future version (tests await it).
        self.version_waited = asyncio.Event()
        self._observers: list[Callable[[Event], None]] = []
        self._pods: dict[Key, StoredPod] = {}
        self._rv = 0
        self._history: list[Event] = []
        self._compacted_rv = 0
        self._history_limit = history_limit
        self._subscribers: set[Subscription] = set()
        self._subscribers_changed = asyncio.Event()
        self._snapshots: OrderedDict[int, _Snapshot] = OrderedDict()

    # ----------------------------------------------------------------- introspection

    @property
    def resource_version(self) -> int:
        """The version of the latest write (0 before the first)."""
        return self._rv

    @property
    def compacted_resource_version(self) -> int:
        """Versions at or below this one can no longer be watched from or listed at."""
        return self._compacted_rv

    @property
    def subscribers(self) -> frozenset[Subscription]:
        """The live watch subscriptions."""
        return frozenset(self._subscribers)

    def __len__(self) -> int:
        return len(self._pods)

    def get(self, namespace: str, name: str) -> StoredPod:
        """The current state of one pod, or a 404 :class:`ApiError`."""
        found = self._pods.get((namespace, name))
        if found is None:
            raise not_found(name)
        return found

    def all(self, namespace: str | None = None) -> list[StoredPod]:
        """Current pods (sorted by namespace, name), optionally in one namespace."""
        pods = self._snapshot(self._rv).pods
        if namespace is None:
            return list(pods)
        return [p for p in pods if p.obj["metadata"]["namespace"] == namespace]

    # ----------------------------------------------------------------- writes

    def create(self, namespace: str, body: Any, *, validate: bool = True) -> StoredPod:
        """Create a pod in ``namespace`` from a request body (POST semantics)."""
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        obj: dict[str, Any] = json.loads(encode(body))  # private deep copy
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if meta.get("namespace", namespace) != namespace:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on the "
                "request"
            )
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created")
        if not meta.get("name") and meta.get("generateName"):
            for _ in range(8):
                meta["name"] = pod_rules.generate_name(str(meta["generateName"]))
                if (namespace, meta["name"]) not in self._pods:
                    break
        obj["kind"] = "Pod"
        obj["apiVersion"] = "v1"
        meta["namespace"] = namespace
        if validate:
            pod_rules.validate_metadata(obj)
            pod_rules.validate_spec(obj)
        name = str(meta.get("name") or "")
        if (namespace, name) in self._pods:
            raise already_exists(name)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        for system in ("deletionTimestamp", "deletionGracePeriodSeconds", "generation"):
            meta.pop(system, None)
        pod_rules.apply_create_defaults(obj)
        return self._commit(ADDED, obj, None)

    def replace(
        self,
        namespace: str,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        validate: bool = True,
    ) -> StoredPod:
        """Update a pod with a full object (PUT, and PATCH after the patch is applied).

        ``subresource="status"`` keeps everything but ``status``; the main resource keeps the
        stored ``status``. A ``metadata.resourceVersion`` in ``body`` that is not the current one
        is a 409 Conflict; an absent one means an unconditional update (pods allow those).
        """
        current = self.get(namespace, name)
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise bad_request("the body of the request must be a JSON object")
        obj: dict[str, Any] = json.loads(encode(body))
        meta = obj.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the "
                f"URL ({name})"
            )
        if meta.get("namespace", namespace) != namespace:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on the "
                "request"
            )
        old = current.obj
        old_meta = old["metadata"]
        wanted_rv = meta.get("resourceVersion")
        if wanted_rv not in (None, "") and str(wanted_rv) != old_meta["resourceVersion"]:
            raise conflict(name)
        if meta.get("uid") not in (None, "", old_meta["uid"]):
            raise conflict(
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {old_meta['uid']}",
            )
        obj["kind"] = "Pod"
        obj["apiVersion"] = "v1"
        meta["name"] = name
        meta["namespace"] = namespace
        for system in (
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
        ):
            if system in old_meta:
                meta[system] = old_meta[system]
            else:
                meta.pop(system, None)
        if subresource == "status":
            status = obj.get("status")
            obj = current.thaw()
            obj["status"] = status if isinstance(status, dict) else {}
        else:
            obj["status"] = old.get("status", {})
            if validate:
                pod_rules.validate_metadata(obj)
                pod_rules.check_spec_update(old, obj)
        meta = obj["metadata"]
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if obj == old:
            return current  # no-op: no new version, no event
        if _removable(meta):
            return self._commit(DELETED, obj, current)
        return self._commit(MODIFIED, obj, current)

    def mutate(
        self, namespace: str, name: str, change: Callable[[dict[str, Any]], None]
    ) -> StoredPod:
        """Apply ``change`` to a copy of the pod and store it, bypassing update validation.

        This is the back door for test hooks (the kubelet and scheduler write status and
        ``nodeName`` through paths clients cannot use).
        """
        current = self.get(namespace, name)
        obj = current.thaw()
        change(obj)
        meta = obj["metadata"]
        meta["resourceVersion"] = current.obj["metadata"]["resourceVersion"]
        if obj == current.obj:
            return current
        if _removable(meta):
            return self._commit(DELETED, obj, current)
        return self._commit(MODIFIED, obj, current)

    def delete(
        self,
        namespace: str,
        name: str,
        preconditions: dict[str, Any] | None = None,
        grace_period_seconds: int | None = None,
    ) -> StoredPod:
        """Delete a pod and return it: at once, or — with finalizers, or with
        :attr:`graceful_deletion` for a scheduled, unfinished pod — mark it Terminating
        (``deletionTimestamp``, ``deletionGracePeriodSeconds``) and leave it until its
        finalizers are gone and its grace is over (:meth:`finish_termination`)."""
        current = self.get(namespace, name)
        meta = current.obj["metadata"]
        pre = preconditions or {}
        if pre.get("uid") not in (None, "", meta["uid"]):
            raise conflict(
                name,
                f"Precondition failed: UID in precondition: {pre['uid']}, "
                f"UID in object meta: {meta['uid']}",
            )
        if pre.get("resourceVersion") not in (None, "", meta["resourceVersion"]):
            raise conflict(
                name,
                "Precondition failed: ResourceVersion in precondition: "
                f"{pre['resourceVersion']}, ResourceVersion in object meta: "
                f"{meta['resourceVersion']}",
            )
        grace = self._grace(current.obj, grace_period_seconds)
        if meta.get("deletionTimestamp"):
            # Already terminating: a second DELETE may only shorten the grace.
            if grace >= (meta.get("deletionGracePeriodSeconds") or 0):
                return current
            obj = current.thaw()
            obj["metadata"]["deletionGracePeriodSeconds"] = grace
            if _removable(obj["metadata"]):
                return self._commit(DELETED, obj, current)
            return self._commit(MODIFIED, obj, current)
        if meta.get("finalizers") or grace > 0:
            obj = current.thaw()
            obj["metadata"]["deletionTimestamp"] = now_rfc3339()
            obj["metadata"]["deletionGracePeriodSeconds"] = grace
            return self._commit(MODIFIED, obj, current)
        return self._commit(DELETED, current.thaw(), current)

    def _grace(self, pod: dict[str, Any], requested: int | None) -> int:
        """The grace a DELETE gives ``pod``: 0 unless graceful deletion is on; then the
        request's, else the pod's ``terminationGracePeriodSeconds``; 0 for a pod never
        scheduled or already finished (nothing runs to stop), as the pod strategy does."""
        if not self.graceful_deletion:
            return 0
        if not (pod.get("spec") or {}).get("nodeName"):
            return 0
        if (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded"):
            return 0
        if requested is not None:
            return max(0, requested)
        return int((pod.get("spec") or {}).get("terminationGracePeriodSeconds") or 0)

    def finish_termination(self, namespace: str, name: str) -> StoredPod | None:
        """The kubelet's part: the containers stopped, so a Terminating pod's grace is over;
        it is removed (unless finalizers hold it). None if it is gone or not terminating."""
        try:
            current = self.get(namespace, name)
        except ApiError:
            return None
        if not current.obj["metadata"].get("deletionTimestamp"):
            return None
        return self.mutate(
            namespace, name, lambda pod: pod["metadata"].update(deletionGracePeriodSeconds=0)
        )

    def _commit(self, kind: str, obj: dict[str, Any], prev: StoredPod | None) -> StoredPod:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        stored = StoredPod.of(obj)
        key = stored.key
        if kind == DELETED:
            del self._pods[key]
        else:
            self._pods[key] = stored
        event = Event(self._rv, kind, stored, prev)
        self._history.append(event)
        if self._history_limit is not None and len(self._history) > self._history_limit + max(
            1, self._history_limit // 10
        ):
            self.compact(keep=self._history_limit)
        for sub in self._subscribers:
            sub.queue.put_nowait(event)
        for observe in self._observers:
            observe(event)
        if self._version_waiters:
            self._wake_version_waiters()
        return stored

    def add_observer(self, observe: Callable[[Event], None]) -> None:
        """Call ``observe`` with every committed event, synchronously (the emulated kubelet);
        unlike a watch it is not counted in :attr:`subscribers`."""
        self._observers.append(observe)

    def remove_observer(self, observe: Callable[[Event], None]) -> None:
        with contextlib.suppress(ValueError):
            self._observers.remove(observe)

    def next_version(self) -> int:
        """Take the next resourceVersion for a write of another kind (a Lease): one counter
        for every object, as etcd has one revision. Pod history simply has a gap there."""
        self._rv += 1
        if self._version_waiters:
            self._wake_version_waiters()
        return self._rv

    def _wake_version_waiters(self) -> None:
        waiting = []
        for rv, future in self._version_waiters:
            if rv <= self._rv:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((rv, future))
        self._version_waiters = waiting

    @property
    def version_waiters(self) -> int:
        """Requests waiting for a future resourceVersion (lists the handler holds)."""
        return len(self._version_waiters)

    async def wait_for_version(self, rv: int, timeout: float) -> bool:
        """Wait until the store reaches ``rv`` (as the watch cache does before serving a list
        at a future version); False after ``timeout``."""
        if rv <= self._rv:
            return True
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._version_waiters.append((rv, future))
        self.version_waited.set()
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            return False
        finally:
            self._version_waiters = [w for w in self._version_waiters if w[1] is not future]
        return True

    # ----------------------------------------------------------------- history

    def compact(self, keep: int = 0) -> int:
        """Drop all but the newest ``keep`` events; return the new compacted version.

        Watches from, and exact lists at, versions below the returned one then get 410.
        """
        drop = max(0, len(self._history) - keep)
        if drop:
            self._compacted_rv = self._history[drop - 1].rv
            del self._history[:drop]
        if keep == 0:
            self._compacted_rv = self._rv
        self._snapshots = OrderedDict(
            (rv, snap) for rv, snap in self._snapshots.items() if rv >= self._compacted_rv
        )
        return self._compacted_rv

    def _events_after(self, rv: int) -> list[Event]:
        start = bisect.bisect_right(self._history, rv, key=lambda e: e.rv)
        return self._history[start:]

    def _snapshot(self, rv: int) -> _Snapshot:
        cached = self._snapshots.get(rv)
        if cached is not None:
            self._snapshots.move_to_end(rv)
            return cached
        state = dict(self._pods)
        if rv < self._rv:
            for event in reversed(self._events_after(rv)):
                key = event.pod.key
                if event.prev is None:
                    state.pop(key, None)
                else:
                    state[key] = event.prev
        keys = sorted(state)
        snap = _Snapshot(keys, [state[k] for k in keys])
        self._snapshots[rv] = snap
        while len(self._snapshots) > _SNAPSHOT_CACHE_SIZE:
            self._snapshots.popitem(last=False)
        return snap

    # ----------------------------------------------------------------- reads

    def list(
        self,
        flt: PodFilter,
        *,
        resource_version: str | None = None,
        resource_version_match: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> ListPage:
        """A (possibly paginated) list with the API server's resourceVersion semantics.

        * unset / ``0`` / NotOlderThan: the current state (a version newer than the current one
          is a 504; the HTTP handler first waits for it, as the real server does for 3 s);
        * ``resourceVersionMatch=Exact``: the state at that version, 410 if compacted;
        * ``continue``: the next page of the snapshot the first page came from, 410 if compacted.
        """
        rv = _parse_rv(resource_version)
        if continue_token:
            at, after = _decode_continue(continue_token)
            if at < self._compacted_rv:
                raise expired(_CONTINUE_EXPIRED)
            if at > self._rv:
                raise bad_request("continue key is not valid: resource version is in the future")
        else:
            after = None
            if resource_version_match not in (None, "", "NotOlderThan", "Exact"):
                raise bad_request(
                    f'resourceVersionMatch: Unsupported value: "{resource_version_match}"'
                )
            if resource_version_match and rv is None:
                raise bad_request(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided"
                )
            if rv is not None and rv > self._rv:
                raise ApiError(
                    504,
                    f"Too large resource version: {rv}, current: {self._rv}",
                    "Timeout",
                    {
                        "causes": [
                            {
                                "reason": "ResourceVersionTooLarge",
                                "message": "Too large resource version",
                            }
                        ],
                        "retryAfterSeconds": 1,
                    },
                )
            if resource_version_match == "Exact" and rv is not None:
                if rv < self._compacted_rv:
                    raise expired("The resourceVersion for the provided list is too old.")
                at = rv
            else:
                at = self._rv
        snap = self._snapshot(at)
        keys, pods = snap.keys, snap.pods
        if flt.namespace is None:
            lo, hi = 0, len(keys)
        else:
            lo = bisect.bisect_left(keys, (flt.namespace,))
            hi = bisect.bisect_left(keys, (flt.namespace + "\x00",))
        if after is not None:
            lo = max(lo, bisect.bisect_right(keys, after))
        everything = flt.everything
        if limit is None or limit <= 0:
            if everything:
                return ListPage(at, [p.raw for p in pods[lo:hi]])
            return ListPage(at, [p.raw for p in pods[lo:hi] if flt.matches(p.obj)])
        items: list[bytes] = []
        index = lo
        while index < hi and len(items) < limit:
            pod = pods[index]
            if everything or flt.matches(pod.obj):
                items.append(pod.raw)
            index += 1
        if index >= hi:
            return ListPage(at, items)
        token = _encode_continue(at, keys[index - 1])
        return ListPage(at, items, token, (hi - index) if everything else None)

    def subscribe(self, flt: PodFilter, resource_version: str | None) -> Subscription:
        """Open a watch; the queue is pre-filled with the replay, then receives live events.

        Unset or ``0``: synthetic ADDED events for the current matching pods, then changes.
        ``v``: every change after ``v`` (410 :class:`ApiError` if ``v`` was compacted away).
        """
        rv = _parse_rv(resource_version)
        if not rv:
            sub = Subscription(flt, self._rv, consumed_rv=self._rv)
            for pod in self._pods.values():
                if flt.matches(pod.obj):
                    sub.queue.put_nowait(
                        Event(pod.resource_version, ADDED, pod, None, synthetic=True)
                    )
        else:
            if rv < self._compacted_rv:
                raise too_old_watch(rv, self._compacted_rv)
            sub = Subscription(flt, rv, consumed_rv=rv)
            for event in self._events_after(rv):
                sub.queue.put_nowait(event)
        self._subscribers.add(sub)
        self._notify_subscribers_changed()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Forget a watch (idempotent)."""
        if sub in self._subscribers:
            self._subscribers.discard(sub)
            self._notify_subscribers_changed()

    def _notify_subscribers_changed(self) -> None:
        self._subscribers_changed.set()
        self._subscribers_changed = asyncio.Event()

    async def wait_subscribers(self, predicate: Callable[[int], bool]) -> None:
        """Wait until ``predicate(number of live watches)`` holds."""
        while not predicate(len(self._subscribers)):
            await self._subscribers_changed.wait()
