"""The reflector's cache and its indexes: per client id, per bounded key, per sandbox, warm pods.

Counting must be O(1) however many pods there are (SPEC S4), and the charge of a
pod follows the *current* key set (SPEC C2: ids are stored, keys are resolved at
use). So the index keeps two layers:

* ``client id label → live sandbox pods``: changes only with pod events;
* ``bounded key → live sandbox pods``: derived from the first layer through the
  shared resolver. When the key set changes (an id joins or leaves the
  allowlist, a flag flips) this layer is rebuilt from the first one — one
  resolution per *distinct client id*, not per pod — before the next count or
  event uses it. The rebuild is lazy: the resolver has no change callback, so
  every count and every event first checks whether the resolver's snapshot is
  still the one the layer was built from (an identity check).

A pod counts when it is a *live sandbox pod*: it has a sandbox-id label, is not
terminating (no ``deletionTimestamp``) and has not finished (phase Succeeded or
Failed). Warm pods (pool label, no sandbox id) count against nobody.
Everything here is synchronous and single-threaded: the reflector applies
events on the event loop, and counts read on the same loop.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

from turnstile_clientkeys import KeySet, Resolver
from turnstile_substrate.kubernetes.podinfo import PodInfo

_NONE: frozenset[str] = frozenset()


class PodIndex:
    """Cached pods by name, with the counting and warm-pool indexes kept in step."""

    def __init__(self, resolver: Resolver, *, on_warm_change: Callable[[], None] | None = None):
        self._resolver = resolver
        self._on_warm_change = on_warm_change
        self.pods: dict[str, PodInfo] = {}
        #: live sandbox pods by sandbox id → {pod name: pod}
        self._by_sandbox: dict[str, dict[str, PodInfo]] = {}
        #: live sandbox pods per client-id label value (None: no label); no zero entries
        self._by_client: dict[str | None, int] = {}
        #: the bounded key of each label in ``_by_client``, at ``_keyset``
        self._label_key: dict[str | None, str] = {}
        #: live sandbox pods per bounded key, derived from ``_by_client``; no zero entries
        self._by_key: dict[str, int] = {}
        self._keyset: KeySet = resolver.keyset
        #: live warm pods by tier → {pod name: pod}, in the order they appeared
        self._warm: dict[str, dict[str, PodInfo]] = {}
        self.key_rebuilds = 0
        #: bumped whenever every sandbox's key may have changed (a fresh list, a
        #: key-set rebuild): a reader mirroring the index must start over
        self.generation = 0
        #: called with a sandbox id whose live pods changed (the live publisher)
        self.on_sandbox_change: Callable[[str], None] | None = None
        #: called with (tier, hit) for each sandbox pod that appeared: hit when the warm
        #: pool made it (its origin label, or the cache saw it warm), else a cold create
        #: (the leader's warm-pool demand, SPEC W1; a restore's pod is none: no warm pod
        #: would have served it); a re-list reports the ones its gap hid
        self.on_demand: Callable[[str, bool], None] | None = None
        #: a first list has been installed (the pods it finds are not new demand)
        self._listed = False
        #: called with a sandbox pod that stopped being live — deleted, terminating, finished
        #: or relabelled — as the cache last saw it (the leader ends its execution row)
        self.on_runtime_gone: Callable[[PodInfo], None] | None = None

    # ------------------------------------------------------------------ writes

    def replace(self, pods: Iterable[PodInfo]) -> None:
        """Install a fresh list (after a list or re-list): the old cache is dropped whole.
        Sandbox pods that were live and are not any more (what a cut watch missed) are
        reported to ``on_runtime_gone``; sandbox pods that appeared meanwhile (live now, not
        live before) are reported to ``on_demand``, after the first list only. A pod
        that came and went within the gap is seen by neither: demand during a watch gap is
        undercounted by the sandboxes that lived less than the gap."""
        was_live = [pod for pod in self.pods.values() if pod.is_sandbox]
        before = self.pods
        self.pods = {}
        self._by_sandbox = {}
        self._by_client = {}
        self._label_key = {}
        self._by_key = {}
        self._warm = {}
        self._keyset = self._resolver.keyset
        self.generation += 1
        for pod in pods:
            old = self.pods.get(pod.name)
            if old is not None:
                self._remove(old)
            self.pods[pod.name] = pod
            self._add(pod)
        self._warm_changed()
        for pod in was_live:
            now = self.pods.get(pod.name)
            if now is None or not now.is_sandbox or now.uid != pod.uid:
                self._runtime_gone(pod)
        if self._listed and self.on_demand is not None:
            for pod in self.pods.values():
                old = before.get(pod.name)
                appeared = old is None or not old.is_sandbox or old.uid != pod.uid
                if pod.is_sandbox and not pod.restore and appeared:
                    self.on_demand(pod.tier, pod.from_pool or (old is not None and old.is_warm))
        self._listed = True

    def upsert(self, pod: PodInfo) -> None:
        """Apply an ADDED or MODIFIED event."""
        self._sync_keys()
        old = self.pods.get(pod.name)
        if old is not None:
            self._remove(old)
        self.pods[pod.name] = pod
        self._add(pod)
        if (old is not None and old.is_warm) or pod.is_warm:
            self._warm_changed()
        if old is not None and old.is_sandbox and not pod.is_sandbox:
            self._runtime_gone(old)
        if (
            self.on_demand is not None
            and pod.is_sandbox
            and not pod.restore
            and (old is None or old.is_warm)
        ):
            self.on_demand(pod.tier, pod.from_pool or old is not None)

    def delete(self, name: str) -> None:
        """Apply a DELETED event."""
        self._sync_keys()
        old = self.pods.pop(name, None)
        if old is not None:
            self._remove(old)
            if old.is_warm:
                self._warm_changed()
            if old.is_sandbox:
                self._runtime_gone(old)

    # ------------------------------------------------------------------ reads

    def count_live(
        self, key: str, exclude_sandbox_id: str | None, pending: Collection[str]
    ) -> tuple[int, frozenset[str]]:
        """Live sandbox pods charged to ``key`` now, but ``exclude_sandbox_id``'s, and
        which ``pending`` sandboxes are already among them.

        O(1) in the number of pods; O(len(pending)) for the pending subset.
        """
        self._sync_keys()
        live = self._by_key.get(key, 0)
        if exclude_sandbox_id and exclude_sandbox_id in self._by_sandbox:
            live -= self._live_in_key(exclude_sandbox_id, key)
        if not pending:
            return live, _NONE
        by_sandbox = self._by_sandbox
        live_pending = frozenset(
            sandbox_id
            for sandbox_id in pending
            if sandbox_id in by_sandbox
            and sandbox_id != exclude_sandbox_id
            and self._live_in_key(sandbox_id, key)
        )
        return live, live_pending

    def live_key(self, sandbox_id: str) -> str | None:
        """The bounded key the sandbox's live pods count against; None if it has none."""
        self._sync_keys()
        for pod in self._by_sandbox.get(sandbox_id, {}).values():
            return self._key_of(pod.client_label)
        return None

    def live_keys(self) -> dict[str, str]:
        """Every live sandbox with its bounded key: O(live sandboxes), for a resync."""
        self._sync_keys()
        return {
            sandbox_id: self._key_of(next(iter(pods.values())).client_label)
            for sandbox_id, pods in self._by_sandbox.items()
        }

    def sync_keys(self) -> None:
        """Apply a key-set change now rather than at the next count or event."""
        self._sync_keys()

    def count_by_key(self) -> dict[str, int]:
        """Every bounded key's live count (for checks and metrics)."""
        self._sync_keys()
        return dict(self._by_key)

    def count_by_client(self) -> dict[str | None, int]:
        """Every client-id label's live count."""
        return dict(self._by_client)

    def live_pods(self, sandbox_id: str) -> list[PodInfo]:
        """The sandbox's live pods (usually one; two while a replacement overlaps)."""
        return list(self._by_sandbox.get(sandbox_id, {}).values())

    def warm(self, tier: str) -> Iterator[PodInfo]:
        """Live unclaimed warm pods of ``tier``, oldest first."""
        return iter(self._warm.get(tier, {}).values())

    def warm_tiers(self) -> list[str]:
        """Tiers that have live warm pods."""
        return list(self._warm)

    def warm_count(self, tier: str) -> int:
        return len(self._warm.get(tier, {}))

    def __len__(self) -> int:
        return len(self.pods)

    # ------------------------------------------------------------------ internals

    def _live_in_key(self, sandbox_id: str, key: str) -> int:
        pods = self._by_sandbox.get(sandbox_id)
        if not pods:
            return 0
        return sum(1 for pod in pods.values() if self._key_of(pod.client_label) == key)

    def _key_of(self, label: str | None) -> str:
        key = self._label_key.get(label)
        if key is None:
            key = self._resolver.resolve_label(label).key
        return key

    def _sync_keys(self) -> None:
        """Rebuild the per-key layer if the key set changed: O(distinct client ids)."""
        keyset = self._resolver.keyset
        if keyset is self._keyset:
            return
        self._keyset = keyset
        self.key_rebuilds += 1
        self.generation += 1
        label_key: dict[str | None, str] = {}
        by_key: dict[str, int] = {}
        for label, count in self._by_client.items():
            key = self._resolver.resolve_label(label).key
            label_key[label] = key
            by_key[key] = by_key.get(key, 0) + count
        self._label_key = label_key
        self._by_key = by_key

    def _add(self, pod: PodInfo) -> None:
        if pod.is_sandbox:
            assert pod.sandbox_id is not None
            self._by_sandbox.setdefault(pod.sandbox_id, {})[pod.name] = pod
            if self.on_sandbox_change is not None:
                self.on_sandbox_change(pod.sandbox_id)
            label = pod.client_label
            count = self._by_client.get(label, 0)
            if count == 0:
                self._label_key[label] = self._resolver.resolve_label(label).key
            self._by_client[label] = count + 1
            key = self._label_key[label]
            self._by_key[key] = self._by_key.get(key, 0) + 1
        elif pod.is_warm:
            self._warm.setdefault(pod.tier, {})[pod.name] = pod

    def _remove(self, pod: PodInfo) -> None:
        if pod.is_sandbox:
            assert pod.sandbox_id is not None
            same = self._by_sandbox[pod.sandbox_id]
            del same[pod.name]
            if not same:
                del self._by_sandbox[pod.sandbox_id]
            if self.on_sandbox_change is not None:
                self.on_sandbox_change(pod.sandbox_id)
            label = pod.client_label
            key = self._label_key[label]
            count = self._by_client[label] - 1
            if count:
                self._by_client[label] = count
            else:
                del self._by_client[label]
                del self._label_key[label]
            left = self._by_key[key] - 1
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]
        elif pod.is_warm:
            tier = self._warm[pod.tier]
            del tier[pod.name]
            if not tier:
                del self._warm[pod.tier]

    def _runtime_gone(self, pod: PodInfo) -> None:
        if self.on_runtime_gone is not None:
            self.on_runtime_gone(pod)

    def _warm_changed(self) -> None:
        if self._on_warm_change is not None:
            self._on_warm_change()
