"""One trace across all three services (SPEC X4, issue: the stack a user runs).

The whole local stack runs as real processes exporting spans over OTLP/gRPC to
a real receiver started by the test (the wire format Jaeger ingests). A Place
whose sandbox is away wakes it: affinity Place → substrate Activate(inherit) →
admission Admit, all in the caller's trace. The cap's live count is a Redis read
inside Admit's one script: no call leaves admission (SPEC S4).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc
import grpc.aio
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

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

PLACE = "/turnstile.affinity.v1.AffinityService/Place"
ACTIVATE = "/turnstile.substrate.v1.SubstrateService/Activate"
ADMIT = "/turnstile.admission.v1.AdmissionService/Admit"
COUNT = "/turnstile.substrate.v1.SubstrateService/CountLiveSandboxes"
SERVER, CLIENT = 2, 3  # OTLP span kinds
EXPECTED = {
    (PLACE, SERVER, "turnstile-affinity"),
    (ACTIVATE, CLIENT, "turnstile-affinity"),
    (ACTIVATE, SERVER, "turnstile-substrate"),
    (ADMIT, CLIENT, "turnstile-substrate"),
    (ADMIT, SERVER, "turnstile-admission"),
}


async def _eventually(probe: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Poll another process's state: no event crosses the process boundary."""
    async with asyncio.timeout(timeout_s):
        while True:
            if await probe():
                return
            await asyncio.sleep(0.1)


def _one(spans: Iterable[ReceivedSpan], name: str, kind: int, service: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.kind == kind and s.service == service]
    assert len(found) == 1, f"{name} ({kind}) in {service}: {found}"
    return found[0]


@pytest.mark.timeout(120)
async def test_a_place_that_wakes_a_sandbox_is_one_trace_across_every_service(
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
    local = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(local))
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        grace_s=30.0,
        extra_env=exporting,
    ) as stack:
        await stack.wait_serving()
        admission_addr, substrate_addr, affinity_addr = stack.addresses
        del admission_addr
        interceptors = client_interceptors(provider)
        async with (
            stack.channel(substrate_addr, interceptors=interceptors) as sub_channel,
            stack.channel(affinity_addr, interceptors=interceptors) as aff_channel,
        ):
            substrate = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
            affinity = affinity_pb2_grpc.AffinityServiceStub(aff_channel)

            async def present() -> bool:
                listed = await affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
                return any(w.sandbox_id == "e2e-sb" for w in listed.workers)

            async def absent() -> bool:
                return not await present()

            await substrate.Activate(
                substrate_pb2.ActivateRequest(
                    sandbox_id="e2e-sb",
                    client=common_pb2.ActivationClient(client_id="acme"),
                )
            )
            await _eventually(present)
            first = await affinity.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id="e2e-chat")
            )
            assert first.sandbox_id == "e2e-sb"
            await affinity.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(sandbox_id="e2e-sb", lease_id=first.lease_id)
            )
            await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="e2e-sb"))
            await _eventually(absent)

            with (
                provider.get_tracer("e2e").start_as_current_span("next turn") as root,
                pytest.raises(grpc.aio.AioRpcError) as caught,
            ):
                await affinity.Place(
                    affinity_pb2.PlaceRequest(client_id="acme", session_id="e2e-chat")
                )
            assert decode(caught.value).reason == "SANDBOX_PENDING"
            trace_id = format(root.get_span_context().trace_id, "032x")
            root_span_id = root.get_span_context().span_id

            def whole_path(got: list[ReceivedSpan]) -> bool:
                seen = {(s.name, s.kind, s.service) for s in got if s.trace_id == trace_id}
                return seen >= EXPECTED

            spans = [
                s
                for s in await otlp_receiver.wait_for(whole_path, timeout=30)
                if s.trace_id == trace_id
            ]
            # The wake brought the sandbox back: its worker attaches again.
            await _eventually(present)
        assert await asyncio.to_thread(stack.interrupt) == 0, stack.output()

    place = _one(spans, PLACE, SERVER, "turnstile-affinity")
    activate_out = _one(spans, ACTIVATE, CLIENT, "turnstile-affinity")
    activate_in = _one(spans, ACTIVATE, SERVER, "turnstile-substrate")
    admit_out = _one(spans, ADMIT, CLIENT, "turnstile-substrate")
    admit_in = _one(spans, ADMIT, SERVER, "turnstile-admission")
    by_id = {s.span_id: s for s in spans}

    def ancestors(span: ReceivedSpan) -> list[str]:
        chain = []
        while span.parent_span_id in by_id:
            span = by_id[span.parent_span_id]
            chain.append(span.span_id)
        return chain

    # Each hop's server span is the child of the caller's client span, and each
    # client span descends from the server span of the service making the call.
    caller = [
        s
        for s in local.get_finished_spans()
        if s.name == PLACE and s.parent is not None and s.parent.span_id == root_span_id
    ]
    assert len(caller) == 1
    assert place.parent_span_id == format(caller[0].context.span_id, "016x")
    assert place.span_id in ancestors(activate_out)
    assert activate_in.parent_span_id == activate_out.span_id
    assert activate_in.span_id in ancestors(admit_out)
    assert admit_in.parent_span_id == admit_out.span_id
    # Admission asks no other service: nothing in the trace descends from Admit,
    # and CountLiveSandboxes (a read API for operators now) is not called at all.
    assert not [s for s in spans if admit_in.span_id in ancestors(s)]
    assert not [s for s in spans if s.name == COUNT]
    assert trace.get_current_span() is trace.INVALID_SPAN
