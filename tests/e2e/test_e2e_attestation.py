"""Worker attestation across the real stack (SPEC Z3): the Direct substrate mints each
runtime's credential, its real worker process attaches with it, and another sandbox's
credential, or a deactivated sandbox's, gets nowhere.

The whole local stack runs as real processes (``turnstilectl up`` with the key pair it
generates). Sandbox B's worker keeps heartbeating during the test, so its presence is
compared field by field without its expiry; every other record of B byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_affinity.store import Keys
from turnstile_contracts import (
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import RichError, decode
from turnstile_testing.stack import run_stack

Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]


async def _eventually(probe: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Poll another process's state: no event crosses the process boundary."""
    async with asyncio.timeout(timeout_s):
        while True:
            if await probe():
                return
            await asyncio.sleep(0.1)


async def _hello(
    stub: affinity_pb2_grpc.AffinityServiceAsyncStub, sandbox_id: str, credential: str
) -> RichError:
    call: Call = stub.Attach(None)
    hello = affinity_pb2.Hello(sandbox_id=sandbox_id, capacity=1, credential=credential)
    await call.write(affinity_pb2.AttachRequest(hello=hello))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    return decode(raised.value)


async def _records_of_b(redis: aioredis.Redis, keys: Keys, session: str) -> dict[str, Any]:
    presence = await redis.hgetall(keys.presence("b"))
    presence.pop(b"expires")  # moved by b's own heartbeats
    return {
        "presence": presence,
        "detached": await redis.dump(keys.detached("b")),
        "leases": await redis.dump(keys.leases("b")),
        "session": await redis.dump(keys.session(session, "acme")),
        "credential": await redis.dump(keys.credential("b")),
    }


@pytest.mark.timeout(180)
async def test_substrate_minted_credentials_attach_real_workers_and_refuse_impostors(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    redis: aioredis.Redis,
) -> None:
    keys = Keys(redis_prefix)
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        _, substrate_addr, affinity_addr = stack.addresses
        async with (
            stack.channel(substrate_addr) as sub_channel,
            stack.channel(affinity_addr) as aff_channel,
        ):
            substrate = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
            affinity = affinity_pb2_grpc.AffinityServiceStub(aff_channel)

            async def present() -> set[str]:
                listed = await affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
                return {w.sandbox_id for w in listed.workers}

            for sandbox_id in ("a", "b"):
                await substrate.Activate(
                    substrate_pb2.ActivateRequest(
                        sandbox_id=sandbox_id,
                        client=common_pb2.ActivationClient(client_id="acme"),
                    )
                )

            async def both_attached() -> bool:
                return await present() >= {"a", "b"}

            # Real worker processes, attached with the credentials the substrate minted.
            await _eventually(both_attached)
            on_a = await affinity.Place(
                affinity_pb2.PlaceRequest(session_id="s-a", client_id="acme")
            )
            on_b = await affinity.Place(
                affinity_pb2.PlaceRequest(session_id="s-b", client_id="acme")
            )
            assert (on_a.sandbox_id, on_b.sandbox_id) == ("a", "b")  # capacity 1 each
            before = await _records_of_b(redis, keys, "s-b")

            a_credential = (tmp_path / "direct" / "a" / "credential").read_text()
            refused = await _hello(affinity, "b", a_credential)
            assert (refused.code, refused.reason) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "WORKER_CREDENTIAL_REFUSED",
            )
            assert refused.metadata["why"] == "wrong_sandbox"
            assert await _records_of_b(redis, keys, "s-b") == before

            # b keeps serving its session.
            await affinity.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(sandbox_id="b", lease_id=on_b.lease_id)
            )
            again = await affinity.Place(
                affinity_pb2.PlaceRequest(session_id="s-b", client_id="acme")
            )
            assert (again.sandbox_id, again.outcome) == ("b", affinity_pb2.PLACEMENT_OUTCOME_HIT)

            # Deactivated: a's credential stops working.
            await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="a"))

            async def a_gone() -> bool:
                return "a" not in await present()

            await _eventually(a_gone)
            revoked = await _hello(affinity, "a", a_credential)
            assert (revoked.code, revoked.metadata["why"]) == (
                grpc.StatusCode.PERMISSION_DENIED,
                "revoked",
            )
            assert "a" not in await present()
