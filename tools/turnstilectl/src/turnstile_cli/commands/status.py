"""``status``: is each service up (gRPC health), and where is it.

A service that cannot be reached for a certificate problem is not "down": its
row says ``TLS PROBLEM`` and a line under the table says what is wrong
(:mod:`turnstile_cli.transport`), and the command exits 5, not 4. It leads with
the target (SPEC M2): which stack, how it was chosen (``target`` in ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio

from rich.markup import escape
from rich.table import Table

from turnstile_cli.context import SERVICES, Context
from turnstile_cli.exits import Exit
from turnstile_cli.transport import Problem, explain

#: The health column of a service whose handshake failed for a transport problem.
TLS_PROBLEM = "TLS PROBLEM"


async def health(ctx: Context, name: str) -> tuple[str, Problem | None]:
    """One service's health status name (``SERVING`` …, ``UNREACHABLE``,
    ``WRONG_IDENTITY``, or :data:`TLS_PROBLEM` with its explanation)."""
    import grpc
    import grpc.aio
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = getattr(ctx.targets, name)
    credentials, options = ctx.credentials(target, getattr(ctx.targets, f"{name}_id"))
    channel = (
        grpc.aio.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.aio.insecure_channel(target)
    )
    async with channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=min(ctx.timeout_s, 2.0)
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                problem = explain(error.details() or "", ctx.tls, ctx.targets, service=name)
                if problem is not None:
                    kind = "WRONG_IDENTITY" if problem.kind == "WRONG_IDENTITY" else TLS_PROBLEM
                    return kind, problem
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return "UNREACHABLE", None
            return error.code().name, None
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return status, None


async def _status(args: argparse.Namespace, ctx: Context) -> int:
    targets = {name: getattr(ctx.targets, name) for name in SERVICES}
    results = await asyncio.gather(*(health(ctx, name) for name in SERVICES))
    statuses = {name: status for name, (status, _) in zip(SERVICES, results, strict=True)}
    problems = {name: p for name, (_, p) in zip(SERVICES, results, strict=True) if p is not None}

    target = ctx.target.describe() if ctx.target is not None else None

    def show(console: object) -> None:
        if target is not None:  # what it looked at first (SPEC M2)
            ctx.out.console.print(f"[bold]target[/]: {escape(target)}", soft_wrap=True)
        table = Table(title="turnstile services", title_justify="left")
        for column in ("service", "address", "health"):
            table.add_column(column)
        for name, status in statuses.items():
            style = "green" if status == "SERVING" else "red"
            table.add_row(name, targets[name], f"[{style}]{status}[/]")
        ctx.out.console.print(table)
        for text in dict.fromkeys(p.text for p in problems.values()):
            ctx.out.failure(text)

    payload: dict[str, dict[str, object]] = {
        name: {"address": targets[name], "health": status} for name, status in statuses.items()
    }
    for name, problem in problems.items():
        payload[name].update(problem=problem.kind, why=problem.text)
    if ctx.target is not None:
        payload["target"] = ctx.target.as_dict()
    # ``-o name``: the services, one a line (what a script then asks about).
    ctx.out.emit(payload, show, listed=list(statuses))
    if problems:
        return Exit.TRANSPORT
    return Exit.OK if all(s == "SERVING" for s in statuses.values()) else Exit.RETRYABLE
