"""Holds under random admit / commit / cancel / double cancel / clock advance:
both buckets stay within [0, capacity], a refused attempt takes nothing, and
tokens are conserved (every token is in a bucket, spent by a live hold, or
refilled by the clock) — against the real scripts on real Redis."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
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
)
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs
from turnstile_admission.settings import AdmissionSettings

RATE, BURST = 2.0, 3.0  # key bucket: 2 tokens/s, capacity 3
CLUSTER_RATE, CLUSTER_BURST = 1.0, 4.0
EPSILON = 1e-6
ENFORCE_ALL = {
    PolicyName.CAP: 2,
    PolicyName.RATE: 2,
    PolicyName.CONCURRENCY: 2,
    PolicyName.SLOTS: 0,
}


class HoldsMachine(RuleBasedStateMachine):
    redis_url: str

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.prefix = f"t:{uuid.uuid4().hex[:12]}:"
        self.redis = aioredis.Redis.from_url(self.redis_url)
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
                cap=CapSettings(default_cap=1000),
                concurrency=ConcurrencySettings(default_limit=2),
            ),
        )
        self.now = 1_000_000_000
        # The model: tokens per bucket (key "a", key "b", cluster) and open holds.
        self.tokens = {"a": BURST, "b": BURST, "cluster": CLUSTER_BURST}
        self.holds: dict[str, tuple[str, int]] = {}  # hold id → (key, expiry ms)
        self.closed: list[str] = []
        self.sandboxes = 0

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

    def in_flight(self, key: str) -> int:
        return sum(1 for k, exp in self.holds.values() if k == key and exp > self.now)

    @rule(key=st.sampled_from(["a", "b"]))
    def admit(self, key: str) -> None:
        before = self.run(self.store.usage(key))
        self.sandboxes += 1
        hold_id = f"h{self.sandboxes:04d}"
        answer = self.run(
            self.store.admit(AdmitArgs(hold_id, key, f"sb-{self.sandboxes}", ENFORCE_ALL))
        )
        enough = self.tokens[key] >= 1 - EPSILON and self.tokens["cluster"] >= 1 - EPSILON
        room = self.in_flight(key) < 2
        assert (answer.outcome == "admit") == (enough and room), answer
        if answer.outcome == "admit":
            self.tokens[key] -= 1
            self.tokens["cluster"] -= 1
            self.holds[hold_id] = (key, answer.hold_expires_ms)
        else:
            after = self.run(self.store.usage(key))
            assert after == before, "a refused attempt took something"

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        hold_id = data.draw(st.sampled_from(sorted(self.holds)))
        _, expiry = self.holds.pop(hold_id)
        self.closed.append(hold_id)
        assert self.run(self.store.commit(hold_id)) == (expiry > self.now)

    @precondition(lambda self: bool(self.holds))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        hold_id = data.draw(st.sampled_from(sorted(self.holds)))
        key, expiry = self.holds.pop(hold_id)
        self.closed.append(hold_id)
        answer = self.run(self.store.cancel(hold_id))
        if expiry <= self.now:
            assert not answer.cancelled
            return
        assert answer.cancelled
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
