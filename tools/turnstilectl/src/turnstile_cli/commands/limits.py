"""``limits``: per-key limits, through admission's admin API (SPEC M1).

Every verb is one ``AdminService`` call with the caller's certificate: admission
authorizes it (operators only), validates the document (``INVALID_ARGUMENT``
naming the field, exit 2, nothing changed), makes the change atomically and
records it in the decision log with the caller's identity and the documents
before and after (``turnstilectl decisions``). ``admit.lua`` reads the documents
on every decision, so there is nothing to reload. A key's limits only apply to
clients that resolve to it: setting them for an id that is not allowlisted is
allowed, and the server's warning is shown.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile_cli.admin_api import (
    DocumentError,
    as_operator,
    target,
    to_document,
    to_message,
)
from turnstile_cli.context import Context
from turnstile_cli.exits import Exit

#: Columns of ``limits get`` (every field a document may hold).
COLUMNS = ("cap", "rate", "burst", "concurrency", "weight", "level", "shadow")


async def _limits(args: argparse.Namespace, ctx: Context) -> int:
    try:
        where = target(args.limits_key, default=args.default, cluster=args.cluster)
        document = _document(args)
    except DocumentError as error:
        ctx.out.failure(str(error))
        return Exit.USAGE
    return await as_operator(ctx, "limits", _call(args, ctx, where, document))


async def _call(args: argparse.Namespace, ctx: Context, where: Any, document: Any) -> int:
    from turnstile_contracts import admission_pb2

    async with ctx.admin() as admin:
        if args.verb == "show":
            request = admission_pb2.GetLimitsRequest()
            if where is not None:
                request.target.CopyFrom(where)
            got = await admin.GetLimits(request)
            return _get(ctx, args.limits_key, got, one=where is not None)
        if args.verb == "delete":
            deleted = await admin.DeleteLimits(admission_pb2.DeleteLimitsRequest(target=where))
            return _deleted(ctx, _name(args), deleted)
        message, paths = document
        if args.verb == "set":
            set_response = await admin.SetLimits(
                admission_pb2.SetLimitsRequest(target=where, limits=message)
            )
            change = set_response.change
        else:
            patch_request = admission_pb2.PatchLimitsRequest(target=where, limits=message)
            patch_request.update_mask.paths.extend(paths)
            change = (await admin.PatchLimits(patch_request)).change
        return _changed(ctx, args.verb, _name(args), change)


def _document(args: argparse.Namespace) -> Any:
    text = getattr(args, "document", None)
    if text is None:
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise DocumentError(
            f"the document is not JSON: {error.msg} (column {error.colno})"
        ) from None
    return to_message(parsed)


def _name(args: argparse.Namespace) -> str:
    """The stored field name (as ``limits get`` lists it)."""
    if args.default:
        return "default"
    if args.cluster:
        return "cluster"
    return f"key:{args.limits_key}"


def _shown(field: str) -> str:
    return field.removeprefix("key:") if field.startswith("key:") else f"the {field}"


def _get(ctx: Context, key: str | None, got: Any, *, one: bool) -> int:
    documents = {d.name: to_document(d.limits) for d in got.documents}
    if not one:
        ctx.out.emit(documents, lambda console: _render_all(console, documents))
        return Exit.OK
    ((field, doc),) = documents.items() if documents else ((None, None),)
    name = field or ("default" if key is None else f"key:{key}")
    ctx.out.emit(
        {"field": field, "limits": doc},
        lambda console: console.print(
            f"{_shown(name)}: "
            + (json.dumps(doc, sort_keys=True) if doc is not None else "none stored (defaults)")
        ),
    )
    return Exit.OK if doc is not None else Exit.ERROR


def _deleted(ctx: Context, field: str, response: Any) -> int:
    before = to_document(response.change.previous) if response.change.HasField("previous") else None
    ctx.out.emit(
        {"field": field, "deleted": response.deleted, "was": before},
        lambda console: console.print(
            f"[green]✓[/] deleted {_shown(field)}'s limits (was {json.dumps(before)}): "
            "the defaults apply"
            if response.deleted
            else f"{_shown(field)} had no limits stored: nothing deleted"
        ),
    )
    return Exit.OK if response.deleted else Exit.ERROR


def _changed(ctx: Context, verb: str, field: str, change: Any) -> int:
    before = to_document(change.previous) if change.HasField("previous") else None
    stored = to_document(change.limits)
    replaced = verb == "set" and before is not None and before != stored
    if change.warning:
        ctx.out.warning(change.warning)

    def told(console: Console) -> None:
        console.print(f"[green]✓[/] {_shown(field)}: {json.dumps(stored, sort_keys=True)}")
        if replaced:
            console.print(
                f"  replaced the whole document {json.dumps(before, sort_keys=True)}; "
                "fields it had and this one lacks now fall back to the defaults "
                "(use patch to change some fields only)"
            )

    payload: dict[str, Any] = {"field": field, "limits": stored, "was": before}
    if change.warning:
        payload["warning"] = change.warning
    ctx.out.emit(payload, told)
    return Exit.OK


def _render_all(console: Console, shown: dict[str, Any]) -> None:
    if not shown:
        console.print("no limits stored: every key has admission's default settings")
        return
    table = Table(title="stored limits", title_justify="left")
    table.add_column("for")
    for column in COLUMNS:
        table.add_column(column)
    for field, doc in shown.items():
        cells = [
            json.dumps(doc[name], sort_keys=True)
            if name == "shadow" and name in doc
            else str(doc.get(name, "-"))
            for name in COLUMNS
        ]
        table.add_row(_shown(field), *cells)
    console.print(table)
