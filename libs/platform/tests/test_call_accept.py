"""A call that reaches a replica too busy to take it up waits for its turn and is
answered (or ended by its caller's deadline), instead of being cancelled by gRPC.

grpc.aio takes arrived calls up one at a time (per method), each on a turn of
the event loop; the others wait inside gRPC, which cancels those that waited
longer than ``grpc.server_max_unrequested_time_in_server`` (30 s unless set).
Their callers got CANCELLED from a handler that never ran: seen as CANCELLED
``Admit`` answers in the cap race on an overloaded replica
(``test_admission_overload.py`` on a Redis Cluster at load average 8-12),
though no one had cancelled them. ``TURNSTILE_CALL_ACCEPT_WAIT_S`` sets that
limit (default 300 s, past every caller's deadline).

gRPC also bounds how many calls may wait so: past 1,000 it cancels arrivals at
random, past 3,000 all of them. A fair-queue benchmark's 10,000 ``Admit``s over
three replicas lost a tenth to a fifth so. The bootstrap sets that bound to the
server's own cap on calls at once.

Here the event loop really stalls (blocked, as a CPU-starved loop is) while
calls arrive from a synchronous client, whose calls gRPC's own threads carry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY

from turnstile_platform.server import GrpcService, connection_options
from turnstile_platform.settings import ServiceSettings
from turnstile_testing.probe import SERVICE, add_probe, settings

#: Calls sent just before the loop stalls: the first is matched to the request
#: grpc.aio has outstanding, the others wait inside gRPC to be taken up.
CALLS = 4
#: gRPC's own limit on that wait when none is set.
GRPC_DEFAULT_S = 30

Start = Callable[[ServiceSettings], Awaitable[int]]


async def _echo(payload: bytes, _: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return payload


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """Start the real bootstrap serving ``test.Probe/Echo``; returns its port."""
    apps: list[GrpcService] = []

    async def started(service_settings: ServiceSettings) -> int:
        app = GrpcService("probe", service_settings, service_names=[SERVICE])
        add_probe(app, {"Echo": _echo})
        apps.append(app)
        return await app.start()

    yield started
    for app in apps:
        await app.stop()


def _handled() -> float:
    """``Echo`` calls the platform interceptor saw end (their handler ran)."""
    total = 0.0
    for code in grpc.StatusCode:
        labels = {"grpc_service": SERVICE, "grpc_method": "Echo", "grpc_code": code.name}
        total += REGISTRY.get_sample_value("turnstile_grpc_server_handled_total", labels) or 0.0
    return total


def _outcome(call: grpc.Future[bytes]) -> str:
    try:
        call.result()
    except grpc.RpcError as error:
        return str(error.code().name)
    return "OK"


async def _through_a_stall(
    port: int, stall_s: float, deadline_s: float, calls_sent: int = CALLS
) -> list[str]:
    """What each of ``calls_sent`` calls got (``OK`` or its status code) when they
    arrive as the server's event loop stalls for ``stall_s``."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        echo = channel.unary_unary(f"/{SERVICE}/Echo", None, None)
        # Connected first, off the loop: a blocking call on it could not be served.
        assert await asyncio.to_thread(echo, b"hello", timeout=30) == b"hello"
        calls = [echo.future(b"n", timeout=deadline_s) for _ in range(calls_sent)]
        # The stall itself: the loop blocked, as a starved one is (a sleep, not a
        # busy loop, so the 32 s one does not take a shared machine's core).
        time.sleep(stall_s)  # noqa: ASYNC251
        return await asyncio.to_thread(lambda: [_outcome(call) for call in calls])


@pytest.mark.slow
async def test_a_call_that_waits_past_grpcs_own_limit_to_be_taken_up_is_answered(
    start: Start,
) -> None:
    port = await start(settings())
    answers = await _through_a_stall(port, stall_s=GRPC_DEFAULT_S + 2, deadline_s=90)
    assert answers == ["OK"] * CALLS


async def test_past_the_accept_wait_grpc_cancels_calls_whose_handler_never_ran(
    start: Start,
) -> None:
    """Why the setting exists: what gRPC does to a call that waited longer than it."""
    port = await start(settings(call_accept_wait_s=1))
    handled = _handled()
    answers = await _through_a_stall(port, stall_s=2.5, deadline_s=30)
    assert sorted(answers) == ["CANCELLED"] * (CALLS - 1) + ["OK"]
    assert _handled() - handled == 2  # the connecting call and the first one


async def test_a_caller_whose_deadline_passes_while_its_call_waits_gets_deadline_exceeded(
    start: Start,
) -> None:
    port = await start(settings())
    answers = await _through_a_stall(port, stall_s=2.5, deadline_s=1)
    assert answers == ["DEADLINE_EXCEEDED"] * CALLS


async def test_a_burst_past_grpcs_own_backlog_limit_is_taken_up_in_turn(start: Start) -> None:
    """1,500 calls arrive while the loop is stalled: past gRPC's 1,000, inside the
    server's cap (its default limits: 1,024 unary calls, 1,024 streams, and room)."""
    port = await start(settings())
    answers = await _through_a_stall(port, stall_s=2.5, deadline_s=60, calls_sent=1500)
    assert answers == ["OK"] * 1500


async def test_calls_past_the_servers_cap_waiting_at_once_are_cancelled_by_grpc(
    start: Start,
) -> None:
    """The backlog's bound is the server's cap (here each limit of 10 twice, for the
    seats levels take back from borrowers, and 64: 104), not unbounded: what
    arrives past it while nothing is taken up is dropped."""
    port = await start(settings(max_concurrent_rpcs=10, max_concurrent_streams=10))
    answers = await _through_a_stall(port, stall_s=2.5, deadline_s=60, calls_sent=300)
    cancelled = answers.count("CANCELLED")
    assert answers.count("OK") + cancelled == 300
    # The one matched to grpc.aio's outstanding request, and the 104 waiting.
    assert 300 - 105 - 5 <= cancelled <= 300 - 104


def test_the_default_accept_wait_outlasts_every_callers_deadline() -> None:
    defaults = ServiceSettings()
    longest_deadline = max(
        getattr(rule, "le", 0) for rule in ServiceSettings.model_fields["rpc_timeout_s"].metadata
    )
    assert defaults.call_accept_wait_s > 2 * longest_deadline
    options = dict(connection_options(defaults, backlog=100))
    assert options["grpc.server_max_unrequested_time_in_server"] == defaults.call_accept_wait_s
