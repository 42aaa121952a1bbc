"""The Redis key layout of admission.

Every admission key sits under one hash tag (``{adm}``), so every script touches
one slot of a Redis Cluster: a decision is one script on one node. Scripts get
every key they can name beforehand in ``KEYS``; the few they learn by reading (a
hold's bucket, a sandbox's node) they build from the base of ``KEYS[1]``, in its
slot (docs/scaling.md). The number of keys per bounded key is fixed; bounded keys are
bounded by the key set (SPEC C3), sandboxes and holds carry their own expiry.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnstile_clientkeys import LiveCountKeys
from turnstile_platform import decision_log


@dataclass(frozen=True)
class AdmissionKeys:
    prefix: str

    @property
    def base(self) -> str:
        """What every admission key starts with: ``<prefix>{adm}:``."""
        return f"{self.prefix}{{adm}}:"

    @property
    def limits(self) -> str:
        """Hash of JSON limits: ``default``, ``cluster`` and ``key:<bounded key>``."""
        return f"{self.base}limits"

    @property
    def cluster_bucket(self) -> str:
        return f"{self.base}cluster-bucket"

    @property
    def nodes(self) -> str:
        """Set of nodes that have slots held (for GetUsage)."""
        return f"{self.base}nodes"

    @property
    def test_clock(self) -> str:
        """Frozen clock in ms, honoured only with ``test_clock`` enabled."""
        return f"{self.base}test-clock"

    @property
    def decisions(self) -> str:
        """Stream: the decision log before SPEC N3, one stream for every key; read
        (not written) while an upgrade's entries age out."""
        return decision_log.decisions_key(self.prefix)

    def decision_stream(self, key: str) -> str:
        """Stream: one bounded key's decision log (SPEC Q3, N3), one entry per
        decision, bounded by length and age (``_decision_stream.lua``)."""
        return decision_log.key_stream(self.prefix, key)

    @property
    def platform_decisions(self) -> str:
        """Stream: the platform's decision log (no client's; audit entries)."""
        return decision_log.platform_stream(self.prefix)

    @property
    def decision_streams(self) -> str:
        """Sorted set: the decision log's streams (``decision_log.streams_index``)."""
        return decision_log.streams_index(self.prefix)

    def shadow_bucket(self, key: str) -> str:
        """Hash like :meth:`bucket`: the key's shadow rate limit's bucket (SPEC Q4)."""
        return f"{self.base}shadow-bucket:{key}"

    def pending(self, key: str) -> str:
        """Sorted set: sandbox id → expiry (ms) of admitted, not yet live, activations."""
        return self.live_counts.pending(key)

    def live(self, key: str) -> str:
        """Set of the key's live sandbox ids, kept by the substrate's leader."""
        return self.live_counts.live(key)

    @property
    def live_state(self) -> str:
        """Whether the live sets are current (see :mod:`turnstile_clientkeys.live_counts`)."""
        return self.live_counts.state

    @property
    def live_counts(self) -> LiveCountKeys:
        return LiveCountKeys(self.prefix)

    def bucket(self, key: str) -> str:
        """Hash: tokens ``t`` at time ``ts`` (ms)."""
        return f"{self.base}bucket:{key}"

    def inflight(self, key: str) -> str:
        """Sorted set: hold id → expiry (ms) of concurrency leases."""
        return f"{self.base}inflight:{key}"

    def hold(self, hold_id: str) -> str:
        return f"{self.base}hold:{hold_id}"

    def settled(self, hold_id: str) -> str:
        """A settled (committed or cancelled) hold's tombstone: ``admit.lua`` takes
        no hold of that id while it lives (a script that reaches Redis after its
        hold was settled, or a second time)."""
        return f"{self.base}settled:{hold_id}"

    def sandbox(self, sandbox_id: str) -> str:
        """Hash: the node whose slot a committed sandbox holds."""
        return f"{self.base}sandbox:{sandbox_id}"

    def slots(self, node: str) -> str:
        """Sorted set: ``h:<hold>`` / ``s:<sandbox>`` → expiry (ms) of held slots."""
        return f"{self.base}slots:{node}"

    def queue(self, level: str, key: str) -> str:
        """Sorted set: waiter id → arrival number, one bounded key's fair-queue
        waiters in a priority level, in FIFO order (the queue's other keys:
        ``_queue.lua``, where the scripts build them)."""
        return f"{self.base}q:key:{level}:{key}"

    def granted(self, owner: str) -> str:
        """Sorted set: the waiters of replica ``owner`` granted since its last tick."""
        return f"{self.base}q:granted:{owner}"

    @property
    def queue_info(self) -> str:
        """Hash: waiter id → its JSON record (state, key, owner, tokens granted)."""
        return f"{self.base}q:info"
