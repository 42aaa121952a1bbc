"""The Python client against the real local stack over mutual TLS: calls succeed,
a refused Admit (an OK response) and a refused Activate (an error) raise the same
Refused, and a server whose certificate names another identity is not talked to."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from turnstile_client import Refused, Tls, TurnstileClient, TurnstileError
from turnstile_clientkeys import KeySetStore
from turnstile_clientkeys.limits import limits_key
from turnstile_contracts import affinity_pb2
from turnstile_testing.stack import RunningStack, run_stack


def _connect(stack: RunningStack, **kwargs: object) -> TurnstileClient:
    admission, substrate, affinity = stack.addresses
    tls = Tls(stack.tls_dir / "cli.crt", stack.tls_dir / "cli.key", stack.tls_dir / "ca.crt")
    return TurnstileClient.connect(
        admission=admission,
        substrate=substrate,
        affinity=affinity,
        tls=tls,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.timeout(120)  # a whole stack start, on a loaded machine
async def test_calls_refusals_and_server_identity_over_mtls(
    tmp_path: Path,
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
) -> None:
    # acme gets a key of its own with one token and almost no refill: one
    # activation passes, the next is refused by the rate policy.
    await KeySetStore(redis, redis_prefix).change(allow=("acme",))
    await redis.hset(limits_key(redis_prefix), "key:acme", json.dumps({"rate": 0.001, "burst": 1}))
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        async with _connect(stack, deadline_s=20) as client:
            activated = await client.activate("sb-client-1", "acme", tier="container")
            assert activated.sandbox.sandbox_id == "sb-client-1"
            assert activated.key.key == "acme"

            # A session acme never placed: Prepare wakes nothing and says so (SPEC W2).
            prepared = await client.prepare("chat-never-placed", "acme")
            assert prepared.outcome == affinity_pb2.PREPARE_OUTCOME_NO_SESSION

            with pytest.raises(Refused) as admit_refused:
                await client.admit("sb-client-2", "acme", tier="container")
            with pytest.raises(Refused) as activate_refused:
                await client.activate("sb-client-3", "acme", tier="container")

        for refused in (admit_refused.value, activate_refused.value):
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (refused.key, refused.policy, refused.reason) == ("acme", "rate", "RATE_LIMITED")
            assert refused.limit is not None
            assert refused.current is not None
            assert refused.retry_after_s is not None
            assert refused.retry_after_s > 0
        assert activate_refused.value.quota_violations[0].subject == "acme"

        # A client expecting substrate's identity at admission's address refuses
        # the handshake: admission's certificate names admission, not substrate.
        wrong = {"admission": "spiffe://turnstile.local/service/substrate"}
        async with _connect(stack, server_ids=wrong, deadline_s=3) as client:
            with pytest.raises(TurnstileError) as mismatch:
                await client.admit("sb-client-4", "acme", tier="container")
        assert mismatch.value.code in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        assert not isinstance(mismatch.value, Refused)
