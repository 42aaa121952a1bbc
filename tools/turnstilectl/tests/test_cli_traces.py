"""Seeing a trace locally: the stack's own OTLP receiver gets the services' spans,
and ``turnstilectl traces`` shows them as trees."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_cli.commands.traces import build
from turnstile_cli.stack.otlp_receiver import read_spans
from turnstile_contracts import (
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_testing.stack import RunningStack, run_stack

PLACE = "/turnstile.affinity.v1.AffinityService/Place"
ACTIVATE = "/turnstile.substrate.v1.SubstrateService/Activate"
ADMIT = "/turnstile.admission.v1.AdmissionService/Admit"


def _cli(stack: RunningStack, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstile_cli", *argv],
        # A wide page: the tree's deepest rows fit on one line whatever the caller's terminal.
        env={**stack.env(), "TURNSTILE_STACK_FILE": str(tmp_path / "stack.json"), "COLUMNS": "250"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _chain(node: dict[str, Any], names: list[str]) -> dict[str, Any] | None:
    """The span named ``names[-1]`` when ``names`` runs down the tree from ``node``,
    each a descendant of the one before (a call's client span may sit between a
    server span and the next service's), else None."""
    if node["name"] == names[0]:
        if len(names) == 1:
            return node
        names = names[1:]
    for child in node["children"]:
        found = _chain(child, names)
        if found is not None:
            return found
    return None


async def _eventually(probe: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    """Poll another process's state: no event crosses the process boundary."""
    async with asyncio.timeout(timeout_s):
        while not await probe():  # noqa: ASYNC110 - the state is in other processes
            await asyncio.sleep(0.1)


async def _wake_by_place(stack: RunningStack) -> None:
    """A Place whose sandbox is away: it wakes it, Place → Activate → Admit."""
    _, substrate_addr, affinity_addr = stack.addresses
    async with (
        stack.channel(substrate_addr) as sub_channel,
        stack.channel(affinity_addr) as aff_channel,
    ):
        substrate = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
        affinity = affinity_pb2_grpc.AffinityServiceStub(aff_channel)

        async def present() -> bool:
            listed = await affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
            return any(w.sandbox_id == "traced-sb" for w in listed.workers)

        async def absent() -> bool:
            return not await present()

        await substrate.Activate(
            substrate_pb2.ActivateRequest(
                sandbox_id="traced-sb", client=common_pb2.ActivationClient(client_id="acme")
            )
        )
        await _eventually(present)
        first = await affinity.Place(
            affinity_pb2.PlaceRequest(client_id="acme", session_id="traced-chat")
        )
        await affinity.ReleaseLease(
            affinity_pb2.ReleaseLeaseRequest(sandbox_id="traced-sb", lease_id=first.lease_id)
        )
        await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="traced-sb"))
        await _eventually(absent)
        with contextlib.suppress(grpc.aio.AioRpcError):  # SANDBOX_PENDING: the wake runs
            await affinity.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id="traced-chat")
            )


def _spans_of(node: dict[str, Any], name: str, service: str) -> int:
    """How many spans of ``name`` by ``service`` are in ``node``'s tree."""
    own = int(node["name"] == name and node["service"] == service)
    return own + sum(_spans_of(child, name, service) for child in node["children"])


@pytest.mark.timeout(120)
async def test_a_place_that_wakes_a_sandbox_shows_as_a_tree_in_turnstilectl_traces(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        grace_s=30.0,
    ) as stack:
        await stack.wait_serving()
        assert "turnstilectl traces (the stack's OTLP receiver on" in stack.output()
        await _wake_by_place(stack)

        found: dict[str, Any] | None = None
        shown = None
        for _ in range(100):  # the services batch their spans for 0.5 s
            shown = await asyncio.to_thread(_cli, stack, tmp_path, "traces", "-o", "json")
            assert shown.returncode == 0, shown.stderr
            found = next(
                (
                    t
                    for t in json.loads(shown.stdout)["traces"]
                    for root in t["roots"]
                    if _chain(root, [PLACE, ACTIVATE, ADMIT]) is not None
                    # admission's own span too: each service exports on its own clock
                    and _spans_of(root, ADMIT, "turnstile-admission")
                ),
                None,
            )
            if found is not None:
                break
            await asyncio.sleep(0.1)
        assert found is not None, shown.stdout if shown else ""

        (place,) = (r for r in found["roots"] if r["name"] == PLACE)
        assert place["service"] == "turnstile-affinity"
        activate = _chain(place, [PLACE, ACTIVATE])
        admit = _chain(place, [PLACE, ACTIVATE, ADMIT])
        assert activate is not None
        assert admit is not None
        assert activate["service"] in ("turnstile-affinity", "turnstile-substrate")
        assert _chain(activate, [ACTIVATE, ADMIT]) is admit
        # The wake runs after Place has answered pending; Admit is inside Activate.
        assert activate["duration_ms"] >= admit["duration_ms"] > 0

        human = await asyncio.to_thread(
            _cli, stack, tmp_path, "traces", "--trace-id", found["trace_id"]
        )
        assert human.returncode == 0, human.stderr
        lines = human.stdout.splitlines()
        assert found["trace_id"] in lines[0]
        rows = {
            n: next(i for i, ln in enumerate(lines) if n in ln) for n in (PLACE, ACTIVATE, ADMIT)
        }
        assert rows[PLACE] < rows[ACTIVATE] < rows[ADMIT]
        indent = {n: len(lines[i]) - len(lines[i].lstrip(" │├└─")) for n, i in rows.items()}
        assert indent[PLACE] < indent[ACTIVATE] < indent[ADMIT]
        # The substrate's client span, then admission's server span under it.
        served = next(
            i for i, ln in enumerate(lines) if ADMIT in ln and "turnstile-admission" in ln
        )
        assert served > rows[ADMIT]
        assert "(client)" in lines[rows[ADMIT]]
        assert " ms" in lines[served]


def test_a_span_whose_parent_is_missing_is_a_root_and_newest_traces_come_first() -> None:
    def span(trace: str, span_id: str, parent: str, start: int, end: int) -> dict[str, Any]:
        return {
            "trace_id": trace,
            "span_id": span_id,
            "parent_span_id": parent,
            "name": span_id,
            "service": "s",
            "start_ns": start,
            "end_ns": end,
        }

    traces = build(
        [
            span("old", "a", "", 0, 10),
            span("old", "b", "a", 1, 5),
            span("new", "c", "gone", 20, 30),
        ]
    )

    assert [t.trace_id for t in traces] == ["new", "old"]
    assert [r.span["name"] for r in traces[0].roots] == ["c"]
    assert [c.span["name"] for c in traces[1].roots[0].children] == ["b"]


_STAND_IN = """\
#!{python}
# A stand-in for Jaeger's binary: serves OTLP where the stack's configuration says.
import asyncio, re, signal, sys
from pathlib import Path
from turnstile_cli.stack.otlp_receiver import OtlpReceiver

config = Path(sys.argv[sys.argv.index("--config") + 1])
receivers = config.read_text().split("\\nreceivers:", 1)[1]
port = int(re.search(r"endpoint: 127\\.0\\.0\\.1:(\\d+)", receivers).group(1))

async def main() -> None:
    receiver = OtlpReceiver(config.parent / "stand-in", port)
    assert await receiver.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await receiver.stop()

asyncio.run(main())
"""


@pytest.mark.timeout(120)
async def test_with_a_jaeger_binary_on_path_the_stack_runs_it_and_its_services_export_there(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    jaeger = bin_dir / "jaeger"
    jaeger.write_text(_STAND_IN.format(python=sys.executable))
    jaeger.chmod(0o755)
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        extra_env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    ) as stack:
        await stack.wait_serving()
        assert "Jaeger UI http://127.0.0.1:" in stack.output()
        described = json.loads((tmp_path / "stack.json").read_text())
        assert described["traces"]["kind"] == "jaeger"
        (pid,) = (p["pid"] for p in described["processes"] if p["command"] == "jaeger")
        async with stack.channel(stack.addresses[1]) as channel:
            await substrate_pb2_grpc.SubstrateServiceStub(channel).Activate(
                substrate_pb2.ActivateRequest(
                    sandbox_id="jaeger-sb", client=common_pb2.ActivationClient(client_id="acme")
                ),
                timeout=20,
            )
        spans_dir = tmp_path / "traces" / "stand-in"

        async def exported() -> bool:
            return any(s["name"] == ACTIVATE for s in read_spans(spans_dir))

        await _eventually(exported, 30)
        shown = await asyncio.to_thread(_cli, stack, tmp_path, "traces")
        assert shown.returncode == 4
        assert described["traces"]["ui"] in shown.stderr

        assert await asyncio.to_thread(stack.interrupt) == 0, stack.output()
    assert not os.path.exists(f"/proc/{pid}")  # noqa: ASYNC240 - one stat
