"""``place``, ``release``, ``sessions``, ``prepare``, ``workers``: the affinity service.

A workspace reset is the one thing a person must not miss: the session's files
are gone. It is printed as a WARNING before anything else (SPEC T8), and in
``--json`` it is the ``reset`` field of the response.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import Output, kv_table, proto_dict, when
from turnstile_contracts import affinity_pb2


def reset_warning(reset: affinity_pb2.WorkspaceReset, session_id: str) -> str:
    why = {
        affinity_pb2.RESET_REASON_GRACE_EXPIRED: "its sandbox stayed away past the grace period",
        affinity_pb2.RESET_REASON_RETIERED: "its sandbox now serves another tier",
        affinity_pb2.RESET_REASON_NOT_OWNED: "its sandbox is no longer its client's",
    }.get(reset.reason, "its sandbox is gone")
    return (
        f"workspace reset: session {session_id} moved from {reset.from_sandbox_id} to "
        f"{reset.to_sandbox_id} at {when(reset.at)} because {why}; "
        "files of the previous workspace are not there"
    )


def warn_reset(out: Output, response: affinity_pb2.PlaceResponse, session_id: str) -> None:
    if response.HasField("reset"):
        out.warning(reset_warning(response.reset, session_id))


async def _place(args: argparse.Namespace, ctx: Context) -> int:
    request = affinity_pb2.PlaceRequest(
        session_id=args.session_id, tier=args.tier, client_id=args.client
    )
    async with ctx.affinity() as stub:
        response = await stub.Place(request)
        released = None
        if args.release:
            done = await stub.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(
                    sandbox_id=response.sandbox_id,
                    lease_id=response.lease_id,
                    client_id=args.client,
                )
            )
            released = done.released
    warn_reset(ctx.out, response, args.session_id)
    payload = proto_dict(response)
    if released is not None:
        payload["lease_released"] = released
    ctx.out.emit(payload, lambda c: render_place(c, args.session_id, response, released))
    return Exit.OK


def outcome_name(outcome: int) -> str:
    name = affinity_pb2.PlacementOutcome.Name(outcome)  # type: ignore[arg-type]
    return name.removeprefix("PLACEMENT_OUTCOME_").lower()


def render_place(
    console: Console,
    session_id: str,
    response: affinity_pb2.PlaceResponse,
    released: bool | None = None,
) -> None:
    outcome = outcome_name(response.outcome)
    style = {"hit": "green", "first": "cyan", "fallback": "yellow"}.get(outcome, "")
    console.print(
        f"[bold green]✓[/] session [bold]{session_id}[/] → sandbox "
        f"[bold]{response.sandbox_id}[/] ([{style}]{outcome}[/])"
    )
    rows: dict[str, object] = {"tier": response.tier or "(none)"}
    if released is None:
        rows["lease"] = response.lease_id
        rows["lease expires"] = when(response.lease_expires_at)
    else:
        rows["lease"] = "released" if released else "already gone"
    if response.endpoint:
        rows["endpoint"] = response.endpoint
    console.print(kv_table(rows))
    if released is None:
        console.print(
            f"[dim]release it when the turn ends: turnstilectl release "
            f"{response.sandbox_id} {response.lease_id}[/]"
        )


async def _release(args: argparse.Namespace, ctx: Context) -> int:
    async with ctx.affinity() as stub:
        response = await stub.ReleaseLease(
            affinity_pb2.ReleaseLeaseRequest(
                sandbox_id=args.sandbox_id, lease_id=args.lease_id, client_id=args.client
            )
        )
    ctx.out.emit(
        proto_dict(response),
        lambda c: c.print(
            "[green]✓ released[/]" if response.released else "already released or expired"
        ),
    )
    return Exit.OK


async def _sessions(args: argparse.Namespace, ctx: Context) -> int:
    """Each session asked for: those found in the table, those not reported by id
    (exit 1 when any is missing), as ``kubectl get a b c`` does."""
    import grpc

    found: list[affinity_pb2.GetSessionResponse] = []
    missing: list[str] = []
    async with ctx.affinity() as stub:
        for session_id in args.session_id:
            try:
                found.append(
                    await stub.GetSession(
                        affinity_pb2.GetSessionRequest(session_id=session_id, client_id=args.client)
                    )
                )
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                missing.append(session_id)
    for session in found:
        if session.HasField("last_reset"):
            ctx.out.warning(reset_warning(session.last_reset, session.session_id))

    def show(console: Console) -> None:
        if found:
            console.print(sessions_table(found))
        for session_id in missing:
            ctx.out.failure(f"no session {session_id} of client {args.client}")

    ctx.out.emit({"sessions": [proto_dict(s) for s in found], "missing": missing}, show)
    return Exit.ERROR if missing else Exit.OK


def sessions_table(sessions: list[affinity_pb2.GetSessionResponse]) -> Table:
    table = Table(title=f"{len(sessions)} session(s)", title_justify="left")
    for column in ("session", "client", "sandbox", "tier", "record expires", "last reset"):
        table.add_column(column)
    for s in sessions:
        reset = (
            f"[yellow]{s.last_reset.from_sandbox_id} → {s.last_reset.to_sandbox_id} "
            f"{when(s.last_reset.at)}[/]"
            if s.HasField("last_reset")
            else "-"
        )
        table.add_row(
            s.session_id,
            s.client_id or "-",
            s.sandbox_id,
            s.tier or "(none)",
            when(s.expires_at),
            reset,
        )
    return table


_PREPARED = {
    affinity_pb2.PREPARE_OUTCOME_RUNNING: "its sandbox {sandbox} is running: nothing to do",
    affinity_pb2.PREPARE_OUTCOME_WAKE_STARTED: "its sandbox {sandbox} is away: wake started",
    affinity_pb2.PREPARE_OUTCOME_ALREADY_WAKING: "its sandbox {sandbox} is away and already waking",
    affinity_pb2.PREPARE_OUTCOME_WILL_MOVE: (
        "its sandbox {sandbox} stayed away past the grace: its next turn moves it to a fresh "
        "workspace"
    ),
    affinity_pb2.PREPARE_OUTCOME_NOT_WOKEN: (
        "its sandbox {sandbox} is away, and this deployment sends no wakes"
    ),
}


async def _prepare(args: argparse.Namespace, ctx: Context) -> int:
    """Prepare (SPEC W2); exit 1 when the client has no such session (nothing done)."""
    async with ctx.affinity() as stub:
        response = await stub.Prepare(
            affinity_pb2.PrepareRequest(session_id=args.session_id, client_id=args.client)
        )
    missing = response.outcome == affinity_pb2.PREPARE_OUTCOME_NO_SESSION

    def show(console: Console) -> None:
        if missing:
            ctx.out.failure(f"no session {args.session_id} of client {args.client}")
            return
        text = _PREPARED.get(response.outcome, "answered {outcome}").format(
            sandbox=response.sandbox_id, outcome=response.outcome
        )
        console.print(f"[bold green]✓[/] session [bold]{args.session_id}[/]: {text}")
        if response.HasField("remaining_grace"):
            grace = response.remaining_grace.ToTimedelta().total_seconds()
            console.print(f"[dim]it keeps that sandbox {grace:.1f} s more[/]")

    payload = proto_dict(response)
    payload["session_id"] = args.session_id
    ctx.out.emit(payload, show)
    return Exit.ERROR if missing else Exit.OK


async def _workers(args: argparse.Namespace, ctx: Context) -> int:
    async with ctx.affinity() as stub:
        response = await stub.ListWorkers(
            affinity_pb2.ListWorkersRequest(tier=args.tier, client_id=args.client)
        )
    ctx.out.emit(proto_dict(response), lambda c: c.print(workers_table(list(response.workers))))
    return Exit.OK


def workers_table(workers: list[affinity_pb2.Worker]) -> Table:
    table = Table(title=f"{len(workers)} worker(s) present", title_justify="left")
    for column in ("sandbox", "client", "tier", "load", "endpoint"):
        table.add_column(column)
    for w in sorted(workers, key=lambda w: (w.tier, w.sandbox_id)):
        load_style = "red" if w.leases >= w.capacity else "green"
        table.add_row(
            w.sandbox_id,
            w.client_id or "-",
            w.tier or "(none)",
            f"[{load_style}]{w.leases}/{w.capacity}[/]",
            w.labels.get("endpoint", "-"),
        )
    return table
