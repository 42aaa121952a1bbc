"""Holds under random admit / commit / cancel / double cancel / release / clock
advance, with every policy enforced — small caps against varying live counts,
node slots on small nodes, concurrency and both buckets: both buckets stay within
[0, capacity], a refused attempt takes nothing, tokens are conserved (every token
is in a bucket, spent by a live hold, or refilled by the clock), and pending
entries, in-flight leases and node slots are exactly the model's (a cancel or a
release that does not free one shows) — against the real scripts on real Redis."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from turnstile_admission.policies import (
    CapSettings,
    ConcurrencySettings,
    PolicyName,
    RateSettings,
    SlotsSettings,
)
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_testing.redis_topologies import connect

RATE, BURST = 2.0, 3.0  # key bucket: 2 tokens/s, capacity 3
CLUSTER_RATE, CLUSTER_BURST = 1.0, 4.0
EPSILON = 1e-6
CAP = 3
NODES = {"n1": 1, "n2": 2}  # slots per node: small, so they run out
TTL_MS = 5_000  # holds and pending entries
COMMITTED_SLOT_MS = 86_400_000
ENFORCE_ALL = {
    PolicyName.CAP: 2,
    PolicyName.RATE: 2,
    PolicyName.CONCURRENCY: 2,
    PolicyName.SLOTS: 2,
}
NO_SLOTS = {**ENFORCE_ALL, PolicyName.SLOTS: 0}


@dataclass
class Hold:
    key: str
    sandbox: str
    expiry: int
    node: str


class HoldsMachine(RuleBasedStateMachine):
    redis_url: str

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.prefix = f"t:{uuid.uuid4().hex[:12]}:"
        self.redis = connect(self.redis_url)
        self.store = AdmissionStore(
            self.redis,
            AdmissionSettings(
                redis_prefix=self.prefix,
                test_clock=True,
                hold_ttl_s=5,
                pending_ttl_s=5,
                rate=RateSettings(
                    default_rate_per_s=RATE,
                    default_burst=BURST,
                    cluster_rate_per_s=CLUSTER_RATE,
                    cluster_burst=CLUSTER_BURST,
                ),
                cap=CapSettings(default_cap=CAP),
                concurrency=ConcurrencySettings(default_limit=2),
                slots=SlotsSettings(per_node=NODES),
            ),
        )
        self.live_keys = LiveCountKeys(self.prefix)
        self.now = 1_000_000_000
        # The model: tokens per bucket (key "a", key "b", cluster), open holds,
        # pending entries, node slots and committed sandboxes.
        self.tokens = {"a": BURST, "b": BURST, "cluster": CLUSTER_BURST}
        self.holds: dict[str, Hold] = {}
        self.closed: list[str] = []
        self.sandboxes = 0
        self.pending: dict[str, tuple[str, int]] = {}  # sandbox → (key, expiry ms)
        self.slots: dict[str, dict[str, int]] = {n: {} for n in NODES}  # member → expiry
        self.committed: dict[str, str] = {}  # sandbox → node ("" when none)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        async def clean() -> None:
            keys = [k async for k in self.redis.scan_iter(match=f"{self.prefix}*")]
            if keys:
                await self.redis.delete(*keys)
            await self.redis.aclose()

        self.run(clean())
        self.loop.close()

    @initialize()
    def freeze_clock(self) -> None:
        self.run(self.store.set_test_clock(self.now))

    async def set_live(self, key: str, live: int) -> None:
        """The substrate leader's view: ``live`` other sandboxes of ``key`` are live."""
        members = self.live_keys.live(key)
        await self.redis.delete(members)
        if live:
            await self.redis.sadd(members, *(f"live-{key}-{i}" for i in range(live)))
        await self.redis.set(self.live_keys.state, COUNTED)

    def in_flight(self, key: str) -> int:
        return sum(1 for h in self.holds.values() if h.key == key and h.expiry > self.now)

    def pending_of(self, key: str) -> list[str]:
        return sorted(sb for sb, (k, exp) in self.pending.items() if k == key and exp > self.now)

    def held(self, node: str) -> int:
        return sum(1 for exp in self.slots[node].values() if exp > self.now)

    @rule(
        key=st.sampled_from(["a", "b"]),
        live=st.integers(min_value=0, max_value=CAP),
        nodes=st.lists(st.sampled_from(sorted(NODES)), unique=True, max_size=2),
    )
    def admit(self, key: str, live: int, nodes: list[str]) -> None:
        self.run(self.set_live(key, live))
        before = self.run(self.store.usage(key))
        self.sandboxes += 1
        hold_id = f"h{self.sandboxes:04d}"
        sandbox = f"sb-{self.sandboxes}"
        pending = self.pending_of(key)
        args = AdmitArgs(
            hold_id,
            key,
            sandbox,
            ENFORCE_ALL if nodes else NO_SLOTS,
            nodes=[(n, NODES[n]) for n in nodes],
        )
        answer = self.run(self.store.admit(args))
        enough = self.tokens[key] >= 1 - EPSILON and self.tokens["cluster"] >= 1 - EPSILON
        room = self.in_flight(key) < 2
        under_cap = live + len(pending) < CAP
        node = next((n for n in nodes if self.held(n) < NODES[n]), "")
        slot = not nodes or bool(node)
        assert (answer.outcome == "admit") == (enough and room and under_cap and slot), answer
        if answer.outcome == "admit":
            assert answer.node == node
            self.tokens[key] -= 1
            self.tokens["cluster"] -= 1
            self.holds[hold_id] = Hold(key, sandbox, answer.hold_expires_ms, node)
            self.pending[sandbox] = (key, self.now + TTL_MS)
            if node:
                self.slots[node][f"h:{hold_id}"] = answer.hold_expires_ms
        else:
            after = self.run(self.store.usage(key))
            assert after == before, "a refused attempt took something"

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        hold_id = data.draw(st.sampled_from(sorted(self.holds)))
        hold = self.holds.pop(hold_id)
        self.closed.append(hold_id)
        assert self.run(self.store.commit(hold_id)) == (hold.expiry > self.now)
        if hold.expiry > self.now:
            self.committed[hold.sandbox] = hold.node
            if hold.node:
                del self.slots[hold.node][f"h:{hold_id}"]
                self.slots[hold.node][f"s:{hold.sandbox}"] = self.now + COMMITTED_SLOT_MS

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        hold_id = data.draw(st.sampled_from(sorted(self.holds)))
        hold = self.holds.pop(hold_id)
        key = hold.key
        self.closed.append(hold_id)
        answer = self.run(self.store.cancel(hold_id))
        if hold.expiry <= self.now:
            assert not answer.cancelled
            return
        assert answer.cancelled
        # Everything the hold took comes back: its pending entry and node slot too.
        del self.pending[hold.sandbox]
        if hold.node:
            del self.slots[hold.node][f"h:{hold_id}"]
        for bucket, capacity, back in (
            (key, BURST, answer.client_tokens),
            ("cluster", CLUSTER_BURST, answer.cluster_tokens),
        ):
            expected = min(1.0, capacity - self.tokens[bucket])
            assert back == pytest.approx(expected, abs=EPSILON)
            self.tokens[bucket] += back

    @precondition(lambda self: bool(self.closed))
    @rule(data=st.data())
    def cancel_again(self, data: st.DataObject) -> None:
        hold_id = data.draw(st.sampled_from(self.closed))
        answer = self.run(self.store.cancel(hold_id))
        assert not answer.cancelled
        assert answer.client_tokens == 0
        assert answer.cluster_tokens == 0

    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        sandbox = data.draw(st.sampled_from(sorted(self.committed)))
        node = self.committed.pop(sandbox)
        released = self.run(self.store.release(sandbox))
        self.pending.pop(sandbox, None)
        if node:
            assert released
            del self.slots[node][f"s:{sandbox}"]

    @rule(ms=st.integers(min_value=1, max_value=6_000))
    def advance_clock(self, ms: int) -> None:
        self.now += ms
        self.run(self.store.set_test_clock(self.now))
        for bucket, rate, capacity in (
            ("a", RATE, BURST),
            ("b", RATE, BURST),
            ("cluster", CLUSTER_RATE, CLUSTER_BURST),
        ):
            self.tokens[bucket] = min(capacity, self.tokens[bucket] + rate * ms / 1000)

    @invariant()
    def buckets_match_the_model_and_stay_within_capacity(self) -> None:
        for key in ("a", "b"):
            usage = self.run(self.store.usage(key))
            assert 0 <= usage.client_tokens <= BURST
            assert 0 <= usage.cluster_tokens <= CLUSTER_BURST
            assert usage.client_tokens == pytest.approx(self.tokens[key], abs=1e-3)
            assert usage.cluster_tokens == pytest.approx(self.tokens["cluster"], abs=1e-3)
            assert usage.in_flight == self.in_flight(key)
            assert sorted(usage.pending_ids) == self.pending_of(key)
            held = {n: self.held(n) for n in NODES if self.held(n)}
            assert usage.node_slots_held == held


@pytest.mark.redis_topologies("cluster")
def test_holds_keep_buckets_within_capacity_and_conserve_tokens(redis_url: str) -> None:
    HoldsMachine.redis_url = redis_url
    run_state_machine_as_test(
        HoldsMachine,
        settings=settings(
            max_examples=40,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
