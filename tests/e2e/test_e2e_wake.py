"""The whole wake on the local stack (SPEC T7): one pending ``Place`` wakes the
sandbox, its worker is forked from the substrate's preloaded launcher and attaches,
and the next ``Place`` is a ``HIT`` on the same sandbox.

No timing is asserted here (``services/affinity/bench/bench_wake.py`` measures it).
What is asserted is what makes a wake fast: the pending answer itself starts the
wake, in its own trace (no sweep, no retry by the client drives it), and the woken
runtime did not start a fresh interpreter but was forked pre-imported.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from opentelemetry.sdk.trace import TracerProvider

from turnstile_contracts import (
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import decode
from turnstile_platform.tracing import client_interceptors
from turnstile_testing.otlp import OtlpReceiver, ReceivedSpan
from turnstile_testing.stack import run_stack

ACTIVATE = "/turnstile.substrate.v1.SubstrateService/Activate"
SERVER = 2
SANDBOX, SESSION = "wake-sb", "wake-chat"


async def _eventually(probe: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    """Poll another process's state: no event crosses the process boundary."""
    async with asyncio.timeout(timeout_s):
        while not await probe():  # noqa: ASYNC110 - the state is in other processes
            await asyncio.sleep(0.1)


def _parent_cmdline(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    ppid = int(stat[stat.rfind(b")") + 2 :].split()[1])
    return Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


@pytest.mark.timeout(180)
async def test_one_pending_place_wakes_the_sandbox_and_the_next_place_hits_it(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    otlp_receiver: OtlpReceiver,
) -> None:
    exporting = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    provider = TracerProvider()
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        grace_s=120.0,
        extra_env=exporting,
    ) as stack:
        await stack.wait_serving()
        _, substrate_addr, affinity_addr = stack.addresses
        interceptors = client_interceptors(provider)
        async with (
            stack.channel(substrate_addr, interceptors=interceptors) as sub_channel,
            stack.channel(affinity_addr, interceptors=interceptors) as aff_channel,
        ):
            substrate = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
            affinity = affinity_pb2_grpc.AffinityServiceStub(aff_channel)

            async def present() -> bool:
                listed = await affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
                return any(w.sandbox_id == SANDBOX for w in listed.workers)

            async def absent() -> bool:
                return not await present()

            await substrate.Activate(
                substrate_pb2.ActivateRequest(
                    sandbox_id=SANDBOX, client=common_pb2.ActivationClient(client_id="acme")
                )
            )
            await _eventually(present)
            first = await affinity.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id=SESSION)
            )
            assert first.sandbox_id == SANDBOX
            await affinity.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(sandbox_id=SANDBOX, lease_id=first.lease_id)
            )
            await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=SANDBOX))
            await _eventually(absent)

            with (
                provider.get_tracer("e2e").start_as_current_span("next turn") as root,
                pytest.raises(grpc.aio.AioRpcError) as caught,
            ):
                await affinity.Place(
                    affinity_pb2.PlaceRequest(client_id="acme", session_id=SESSION)
                )
            assert decode(caught.value).reason == "SANDBOX_PENDING"
            trace_id = format(root.get_span_context().trace_id, "032x")

            # No other Place meanwhile: the one pending answer drives the wake.
            await _eventually(present)
            hit = await affinity.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id=SESSION)
            )
            assert hit.sandbox_id == SANDBOX
            assert hit.outcome == affinity_pb2.PLACEMENT_OUTCOME_HIT

            def woken(spans: list[ReceivedSpan]) -> bool:
                return any(
                    s.trace_id == trace_id and s.name == ACTIVATE and s.kind == SERVER
                    for s in spans
                )

            spans = await otlp_receiver.wait_for(woken, timeout=30)
            record = json.loads((tmp_path / "direct" / SANDBOX / "runtime.json").read_text())
            launched_by = _parent_cmdline(record["pid"])
        assert await asyncio.to_thread(stack.interrupt) == 0, stack.output()

    # The wake is the pending Place's own background Activate, once.
    activations = [s for s in spans if s.name == ACTIVATE and s.kind == SERVER]
    assert [s.trace_id for s in activations].count(trace_id) == 1
    # The woken worker was forked by the preloaded launcher, not started afresh.
    assert "turnstile_substrate.direct.launcher" in launched_by
    assert "turnstile_affinity.worker.__main__:main" in launched_by
