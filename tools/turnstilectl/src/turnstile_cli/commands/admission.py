"""``admit``, ``hold commit|cancel``, ``usage``: the admission service, directly.

``admit`` runs every policy and, when admitted, takes a hold exactly as the
substrate would before creating a runtime: commit or cancel it afterwards (an
uncommitted hold expires on its own).
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile_cli.clients import client_from_args, describe
from turnstile_cli.commands.base import queue_per_client_without_wait
from turnstile_cli.commands.queue_watch import new_wait_id, watched
from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import kv_table, proto_dict, queue_rows, retry_text, when
from turnstile_contracts import admission_pb2, common_pb2

KINDS = {
    "cold": common_pb2.ACTIVATION_KIND_COLD_CREATE,
    "warm": common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    "resume": common_pb2.ACTIVATION_KIND_RESUME,
    "restore": common_pb2.ACTIVATION_KIND_RESTORE,
}

VERDICT_STYLES = {
    admission_pb2.VERDICT_PASS: "green",
    admission_pb2.VERDICT_REFUSE: "bold red",
    admission_pb2.VERDICT_SHADOW_REFUSE: "yellow",
    admission_pb2.VERDICT_UNKNOWN: "magenta",
    admission_pb2.VERDICT_SKIPPED: "dim",
}


async def _admit(args: argparse.Namespace, ctx: Context) -> int:
    if args.commit and args.cancel:
        ctx.out.failure("--commit and --cancel exclude each other")
        return Exit.USAGE
    if args.dry_run and (args.commit or args.cancel):
        ctx.out.failure("a --dry-run takes no hold to --commit or --cancel")
        return Exit.USAGE
    if queue_per_client_without_wait(args, ctx):
        return Exit.USAGE
    request = admission_pb2.AdmitRequest(
        sandbox_id=args.sandbox_id,
        client=client_from_args(args),
        kind=KINDS[args.kind],
        tier=args.tier,
        candidate_nodes=args.node,
        dry_run=args.dry_run,
        queue_per_client=args.queue_per_client,
    )
    timeout = None
    if args.wait > 0:
        request.wait_budget.FromMilliseconds(round(args.wait * 1000))
        request.wait_id = new_wait_id()
        timeout = args.wait + 10
    async with ctx.admission() as stub:
        answer = stub.Admit(request, timeout=timeout)
        if args.wait > 0 and not args.dry_run:
            response = await watched(ctx, request.client, request.wait_id, answer)
        else:
            response = await answer
        settled: str | None = None
        if response.decision == admission_pb2.DECISION_ADMITTED and (args.commit or args.cancel):
            if args.commit:
                done = await stub.CommitHold(
                    admission_pb2.CommitHoldRequest(hold_id=response.hold_id)
                )
                settled = "committed" if done.committed else "already settled"
            else:
                undone = await stub.CancelHold(
                    admission_pb2.CancelHoldRequest(hold_id=response.hold_id)
                )
                settled = "cancelled" if undone.cancelled else "already settled"
    payload = proto_dict(response)
    if settled is not None:
        payload["hold_settled"] = settled
    refused = response.decision == admission_pb2.DECISION_REFUSED
    if refused:
        payload["error"] = refusal_dict(response)
    ctx.out.emit(payload, lambda console: render_admit(console, args.sandbox_id, response, settled))
    return Exit.REFUSED if refused else Exit.OK


def refusal_dict(response: admission_pb2.AdmitResponse) -> dict[str, Any]:
    """A refused decision in the shape of ``--json`` errors (docs/cli.md): scripts
    read ``error.retry_after_s`` as a number of seconds, whatever refused. The
    reason and hint are the client library's (:func:`turnstile_client.refused_admit`),
    the same a refused ``Activate`` carries."""
    from turnstile_client import refused_admit

    refused = refused_admit(response)
    return {
        "code": "REFUSED",
        "reason": refused.reason,
        "message": response.message,
        "retry_after_s": refused.retry_after_s,
    }


def render_admit(
    console: Console,
    sandbox_id: str,
    response: admission_pb2.AdmitResponse,
    settled: str | None = None,
) -> None:
    key = response.key
    key_text = f"{key.key} ({_key_kind(key.kind)}, key set v{key.key_set_version})"
    dry = " [bold](dry run: nothing taken)[/]" if response.dry_run else ""
    if response.decision == admission_pb2.DECISION_ADMITTED:
        console.print(f"[bold green]✓ admitted[/] sandbox [bold]{sandbox_id}[/] as {key_text}{dry}")
        rows: dict[str, object] = {"hold": response.hold_id or "none (dry run)"}
        if settled:
            rows["hold state"] = settled
        elif not response.dry_run:
            rows["hold expires"] = when(response.hold_expires_at)
        if response.node:
            rows["node"] = response.node
    else:
        policy = _policy(response.refused_by)
        console.print(
            f"[bold red]✗ refused[/] sandbox [bold]{sandbox_id}[/] as {key_text} "
            f"by the [bold]{policy}[/] policy{dry}"
        )
        rows = {"limit": response.limit, "current": response.current}
        if response.HasField("retry_after"):
            seconds = response.retry_after.ToTimedelta().total_seconds()
            rows["retry"] = retry_text(seconds).removeprefix("retry ")
    queue_rows(rows, response)
    if response.message:
        rows["summary"] = response.message
    for shadow in response.shadow_verdicts:
        verdict = admission_pb2.Verdict.Name(shadow.verdict).removeprefix("VERDICT_").lower()
        rows[f"shadow {_policy(shadow.policy)}"] = (
            f"{verdict}: {shadow.current} against a shadow limit of {shadow.limit}"
        )
    console.print(kv_table(rows))
    console.print(verdicts_table(response.verdicts))


def verdicts_table(verdicts: object) -> Table:
    table = Table(title="policies, in evaluation order", title_justify="left")
    for column in ("policy", "mode", "verdict", "limit", "current", "detail"):
        table.add_column(column)
    for v in verdicts:  # type: ignore[attr-defined]
        style = VERDICT_STYLES.get(v.verdict, "")
        verdict = admission_pb2.Verdict.Name(v.verdict).removeprefix("VERDICT_").lower()
        table.add_row(
            _policy(v.policy),
            admission_pb2.PolicyMode.Name(v.mode).removeprefix("POLICY_MODE_").lower(),
            f"[{style}]{verdict}[/]" if style else verdict,
            str(v.limit) if v.limit else "-",
            str(v.current),
            v.detail,
        )
    return table


async def _hold(args: argparse.Namespace, ctx: Context) -> int:
    async with ctx.admission() as stub:
        if args.verb == "commit":
            committed = await stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=args.hold_id))
            committed = await stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=args.hold_id))
            if not committed.committed:
                return _no_hold(ctx, args.hold_id, proto_dict(committed))
            ctx.out.emit(proto_dict(committed), lambda c: c.print("[green]✓ committed[/]"))
            return Exit.OK
        cancelled = await stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=args.hold_id))
    if not cancelled.cancelled:
        return _no_hold(ctx, args.hold_id, proto_dict(cancelled))
    ctx.out.emit(
        proto_dict(cancelled),
        lambda console: console.print(
            f"[green]✓ cancelled[/]: {cancelled.client_tokens_returned:g} token(s) back to the "
            f"key's bucket, {cancelled.cluster_tokens_returned:g} to the cluster's"
        ),
    )
    return Exit.OK


def _no_hold(ctx: Context, hold_id: str, payload: dict[str, Any]) -> int:
    """Nothing was settled: the hold is unknown, expired or settled already (exit 1,
    as NOT_FOUND is: the command did not do what it was asked)."""
    text = f"hold {hold_id}: unknown, expired or already settled; nothing changed"
    if ctx.out.json_mode:
        ctx.out.print_json({**payload, "error": {"code": "NOT_FOUND", "message": text}})
    else:
        ctx.out.failure(text)
    return Exit.ERROR


async def _usage(args: argparse.Namespace, ctx: Context) -> int:
    client = client_from_args(args)
    async with ctx.admission() as stub:
        usage = await stub.GetUsage(admission_pb2.GetUsageRequest(client=client))
    ctx.out.emit(proto_dict(usage), lambda console: render_usage(console, describe(client), usage))
    return Exit.OK


#: What an unknown live count means for the cap, in the words ``usage`` prints.
_LIVE_UNKNOWN = {
    "unsupported": "unknown: the substrate does not count live sandboxes (on Direct, "
    "TURNSTILE_DIRECT_LIVE_COUNTS=unsupported), so the cap admits",
    "unavailable": "unknown: no current count from the substrate's leader (none is "
    "running, or it fell behind), so the cap counts pending alone",
}


def render_usage(console: Console, who: str, usage: admission_pb2.GetUsageResponse) -> None:
    key = usage.key
    console.print(
        f"[bold]{who}[/] → key [bold]{key.key}[/] ({_key_kind(key.kind)}, "
        f"key set v{key.key_set_version})"
    )
    live = (
        str(usage.live)
        if usage.HasField("live")
        else _LIVE_UNKNOWN.get(usage.live_unknown, "unknown")
    )
    rows: dict[str, object] = {
        "live": live,
        "pending": usage.pending,
        "cap": f"{(usage.live if usage.HasField('live') else 0) + usage.pending} of {usage.cap}"
        if usage.HasField("live")
        else f"{usage.pending} pending of {usage.cap}",
        "tokens": f"{usage.client_tokens:.1f} of {usage.client_capacity:g}",
        # A bucket's burst is at least 1: a capacity of 0 is the field left out for a
        # caller scoped to some clients (a tenant's certificate).
        "cluster tokens": f"{usage.cluster_tokens:.1f} of {usage.cluster_capacity:g}"
        if usage.cluster_capacity
        else "not shown to this identity (it sees its own key only)",
        "in flight": f"{usage.in_flight} of {usage.concurrency_limit}",
    }
    if usage.node_slots_held:
        rows["node slots held"] = ", ".join(
            f"{node}={held}" for node, held in sorted(usage.node_slots_held.items())
        )
    console.print(kv_table(rows))


def _policy(policy: admission_pb2.Policy.ValueType) -> str:
    return admission_pb2.Policy.Name(policy).removeprefix("POLICY_").lower()


def _key_kind(kind: common_pb2.KeyKind.ValueType) -> str:
    return common_pb2.KeyKind.Name(kind).removeprefix("KEY_KIND_").lower()
