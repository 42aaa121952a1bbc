"""``activate``, ``deactivate``, ``sandboxes``: the substrate service."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from turnstile_cli.clients import client_from_args
from turnstile_cli.commands.base import queue_per_client_without_wait
from turnstile_cli.commands.queue_watch import new_wait_id, watched
from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import kv_table, proto_dict, queue_rows, when
from turnstile_contracts import common_pb2, substrate_pb2

OUTCOME_STYLES = {
    "already_running": "cyan",
    "created": "green",
    "warm_claimed": "green",
    "restored": "green",
    "resumed": "green",
}


async def _activate(args: argparse.Namespace, ctx: Context) -> int:
    if queue_per_client_without_wait(args, ctx):
        return Exit.USAGE
    charged = client_from_args(args)
    wait_id = new_wait_id() if args.wait > 0 else ""
    async with ctx.client("substrate") as client:
        answer = client.activate(
            args.sandbox_id,
            charged,
            tier=args.tier,
            dry_run=args.dry_run,
            wait_s=args.wait,
            queue_per_client=args.queue_per_client,
            wait_id=wait_id,
        )
        if wait_id and not args.dry_run:
            response = await watched(ctx, charged, wait_id, answer)
        else:
            response = await answer
    ctx.out.emit(proto_dict(response), lambda console: render_activate(console, response))
    return Exit.OK


def outcome_name(outcome: int) -> str:
    return substrate_pb2.Outcome.Name(outcome).removeprefix("OUTCOME_").lower()  # type: ignore[arg-type]


def render_activate(console: Console, response: substrate_pb2.ActivateResponse) -> None:
    sandbox = response.sandbox
    outcome = outcome_name(response.outcome)
    style = OUTCOME_STYLES.get(outcome, "")
    dry = " [bold](dry run: would be; nothing was made or charged)[/]" if response.dry_run else ""
    console.print(
        f"[bold green]✓[/] sandbox [bold]{sandbox.sandbox_id}[/]: [{style}]{outcome}[/]{dry}"
    )
    rows: dict[str, object] = {
        "tier": sandbox.tier or "(default)",
        "runtime": sandbox.runtime_name or "-",
        "charged to": response.charged_client_id
        if response.HasField("charged_client_id")
        else "(unattributed)",
    }
    if response.HasField("key") and response.key.key:
        kind = common_pb2.KeyKind.Name(response.key.kind).removeprefix("KEY_KIND_").lower()
        rows["bounded key"] = (
            f"{response.key.key} ({kind}, key set v{response.key.key_set_version})"
        )
    queue_rows(rows, response, "admission's fair queue")
    if sandbox.node:
        rows["node"] = sandbox.node
    if sandbox.endpoint:
        rows["endpoint"] = sandbox.endpoint
    console.print(kv_table(rows))


async def _deactivate(args: argparse.Namespace, ctx: Context) -> int:
    import grpc

    async with ctx.substrate() as stub:
        response = await stub.Deactivate(
            substrate_pb2.DeactivateRequest(sandbox_id=args.sandbox_id)
        )
        if not response.stopped:
            # Deactivate is idempotent: "nothing was running" is also its answer for
            # a sandbox that does not exist, which a person mistyped.
            try:
                await stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id=args.sandbox_id))
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                ctx.out.failure(f"no sandbox {args.sandbox_id}: nothing to stop", code="NOT_FOUND")
                return Exit.ERROR
    ctx.out.emit(
        proto_dict(response),
        lambda c: c.print(
            f"[green]✓ stopped[/] {args.sandbox_id}"
            if response.stopped
            else f"{args.sandbox_id} had no running runtime"
        ),
    )
    return Exit.OK


async def _sandboxes(args: argparse.Namespace, ctx: Context) -> int:
    async with ctx.substrate() as stub:
        if args.sandbox_id:
            one = await stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id=args.sandbox_id))
            ctx.out.emit(
                {"sandbox": proto_dict(one.sandbox)},
                lambda c: c.print(sandboxes_table([one.sandbox])),
            )
            return Exit.OK
        found: list[substrate_pb2.Sandbox] = []
        token = args.page_token
        while True:
            want = 1000 if args.limit <= 0 else min(1000, args.limit - len(found))
            page = await stub.ListSandboxes(
                substrate_pb2.ListSandboxesRequest(
                    page_size=want, page_token=token, client_id=args.client
                )
            )
            found.extend(page.sandboxes)
            token = page.next_page_token
            if not token or (args.limit > 0 and len(found) >= args.limit):
                break
    ctx.out.emit(
        {"sandboxes": [proto_dict(s) for s in found], "next_page_token": token},
        lambda c: c.print(sandboxes_table(found)),
    )
    return Exit.OK


def sandboxes_table(sandboxes: list[substrate_pb2.Sandbox]) -> Table:
    table = Table(title=f"{len(sandboxes)} sandbox(es)", title_justify="left")
    for column in ("sandbox", "state", "tier", "client", "runtime", "node/endpoint", "updated"):
        table.add_column(column, no_wrap=column in ("sandbox", "state"))
    for s in sandboxes:
        state = substrate_pb2.SandboxState.Name(s.state).removeprefix("SANDBOX_STATE_").lower()
        style = {"running": "green", "stopped": "dim", "activating": "yellow"}.get(state, "")
        table.add_row(
            s.sandbox_id,
            f"[{style}]{state}[/]" if style else state,
            s.tier or "(default)",
            s.activating_client_id if s.HasField("activating_client_id") else "[dim]—[/]",
            s.runtime_name or "-",
            s.node or s.endpoint or "-",
            when(s.updated_at),
        )
    return table
