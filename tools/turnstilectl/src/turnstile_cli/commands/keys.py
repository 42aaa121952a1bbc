"""``keys``: the key set (allowlist + flags) every replica resolves client ids with.

Through admission's admin API (SPEC M1) with the caller's certificate: ``show``
is ``GetKeySet``, ``allow``/``remove``/``flags NAME=on|off`` one ``UpdateKeySet``
(a new version every replica of every service installs within about a second,
SPEC C2). Admission authorizes it (operators only), checks each id (an invalid
one, or one that would never get a key of its own, is ``INVALID_ARGUMENT``:
exit 2, nothing changed) and records the change in the decision log.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile_cli.admin_api import as_operator, keyset_dict
from turnstile_cli.context import Context
from turnstile_cli.exits import Exit

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


class _BadFlagError(ValueError):
    pass


async def _keys(args: argparse.Namespace, ctx: Context) -> int:
    try:
        change = _change(args)
    except _BadFlagError as error:
        ctx.out.failure(str(error))
        return Exit.USAGE
    return await as_operator(ctx, "keys", _call(args, ctx, change))


async def _call(args: argparse.Namespace, ctx: Context, change: Any) -> int:
    from turnstile_contracts import admission_pb2

    resolved: dict[str, Any] = {}
    async with ctx.admin() as admin:
        if change is None:
            ids = list(args.client_id) if args.verb == "show" else []
            shown = await admin.GetKeySet(admission_pb2.GetKeySetRequest(client_ids=ids))
            keyset = shown.key_set
            for item in shown.resolved:
                kind = admission_kind(item.key.kind)
                resolved[item.client_id] = {"key": item.key.key, "kind": kind}
        else:
            keyset = (await admin.UpdateKeySet(change)).key_set
        payload = keyset_dict(keyset)
        if args.verb == "show" and args.client_id:
            payload["resolved"] = resolved
        ctx.out.emit(payload, lambda c: _render(c, args.verb, payload, resolved, changed=change))
        return Exit.OK


def admission_kind(kind: int) -> str:
    from turnstile_contracts import common_pb2

    return common_pb2.KeyKind.Name(kind).removeprefix("KEY_KIND_").lower()  # type: ignore[arg-type]


def _change(args: argparse.Namespace) -> Any:
    """The ``UpdateKeySetRequest`` of a changing verb (None: a read)."""
    from turnstile_contracts import admission_pb2

    if args.verb == "allow":
        return admission_pb2.UpdateKeySetRequest(allow=args.client_id)
    if args.verb == "remove":
        return admission_pb2.UpdateKeySetRequest(remove=args.client_id)
    if args.verb == "flags" and args.assignment:
        flags: dict[str, bool] = {}
        for assignment in args.assignment:
            name, _, value = assignment.partition("=")
            if value.lower() in _TRUE:
                flags[name] = True
            elif value.lower() in _FALSE:
                flags[name] = False
            else:
                raise _BadFlagError(f"{assignment!r}: give NAME=on or NAME=off")
        return admission_pb2.UpdateKeySetRequest(flags=flags)
    return None


def _render(
    console: Console,
    verb: str,
    keyset: dict[str, Any],
    resolved: dict[str, Any],
    *,
    changed: Any,
) -> None:
    if changed is not None:
        console.print(f"[green]✓[/] key set is now version [bold]{keyset['version']}[/]")
    else:
        console.print(f"key set version [bold]{keyset['version']}[/]")
    if verb != "flags":
        table = Table(title="allowlist (own buckets)", title_justify="left")
        table.add_column("client id")
        for client_id in keyset["allowlist"]:
            table.add_row(client_id)
        console.print(table)
    flags = Table(title="flags", title_justify="left")
    flags.add_column("flag")
    flags.add_column("value")
    for name, value in keyset["flags"].items():
        flags.add_row(name, "[green]on[/]" if value else "[red]off[/]")
    console.print(flags)
    if resolved:
        table = Table(title="resolution", title_justify="left")
        for column in ("client id", "bounded key", "kind"):
            table.add_column(column)
        for client_id, key in resolved.items():
            table.add_row(client_id, key["key"], key["kind"])
        console.print(table)
