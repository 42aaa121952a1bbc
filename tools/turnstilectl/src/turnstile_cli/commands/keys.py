"""``keys``: the key set (allowlist + flags) every replica resolves client ids with.

Changes go through :class:`turnstile_clientkeys.KeySetStore` on Redis: one
optimistic transaction bumps the version and announces it, and every replica
of every service installs it within about a second (SPEC C2). There is no admin
RPC for it: the key set's source of truth is Redis, and this is its one writer
besides the services' first-start bootstrap.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_clientkeys import (
    RESERVED_IDS,
    KeySet,
    KeySetError,
    KeySetStore,
    Resolver,
    client_id_problem,
    is_label_value,
)
from turnstile_clientkeys.keyset import KNOWN_FLAGS
from turnstile_platform.redis_client import create_redis

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


async def _keys(args: argparse.Namespace, ctx: Context) -> int:
    url, prefix = ctx.redis_target(args.redis_url, args.redis_prefix)
    try:
        changes = _changes(args)
    except KeySetError as error:
        ctx.out.failure(str(error))
        return Exit.USAGE
    redis = create_redis(url, timeout_s=min(ctx.timeout_s, 5.0))
    try:
        store = KeySetStore(redis, prefix)
        if changes is None:
            keyset = await store.load()
        else:
            keyset = await store.change(**changes)
    finally:
        await redis.aclose()
    for client_id in getattr(args, "client_id", []):
        if args.verb == "allow" and (client_id in RESERVED_IDS or not is_label_value(client_id)):
            ctx.out.warning(
                f"{client_id!r} is allowlisted but resolves to the shared key: "
                + (
                    "it is a reserved id"
                    if client_id in RESERVED_IDS
                    else "it is not a Kubernetes label value"
                )
            )
    payload = keyset_dict(keyset)
    resolved: dict[str, Any] = {}
    if args.verb == "show" and args.client_id:
        resolver = Resolver(keyset)
        for client_id in args.client_id:
            key = resolver.resolve_id(client_id)
            resolved[client_id] = {"key": key.key, "kind": key.kind.value}
        payload["resolved"] = resolved
    ctx.out.emit(payload, lambda c: _render(c, args.verb, keyset, resolved))
    return Exit.OK


def _changes(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.verb == "allow":
        for client_id in args.client_id:
            problem = client_id_problem(client_id)
            if problem is not None:
                raise KeySetError(f"client id {client_id!r} {problem}")
        return {"allow": tuple(args.client_id)}
    if args.verb == "remove":
        return {"remove": tuple(args.client_id)}
    if args.verb == "flags" and args.assignment:
        flags: dict[str, bool] = {}
        for assignment in args.assignment:
            name, _, value = assignment.partition("=")
            if name not in KNOWN_FLAGS:
                known = ", ".join(sorted(KNOWN_FLAGS))
                raise KeySetError(f"unknown flag {name!r}; known: {known}")
            if value.lower() in _TRUE:
                flags[name] = True
            elif value.lower() in _FALSE:
                flags[name] = False
            else:
                raise KeySetError(f"{assignment!r}: give NAME=on or NAME=off")
        return {"flags": flags}
    return None


def keyset_dict(keyset: KeySet) -> dict[str, Any]:
    return {
        "version": keyset.version,
        "allowlist": sorted(keyset.allowlist),
        "flags": {name: keyset.flag(name) for name in sorted({*KNOWN_FLAGS, *keyset.flags})},
    }


def _render(console: Console, verb: str, keyset: KeySet, resolved: dict[str, Any]) -> None:
    if verb in ("allow", "remove") or (verb == "flags" and keyset.version):
        console.print(f"[green]✓[/] key set is now version [bold]{keyset.version}[/]")
    else:
        console.print(f"key set version [bold]{keyset.version}[/]")
    if verb != "flags":
        table = Table(title="allowlist (own buckets)", title_justify="left")
        table.add_column("client id")
        table.add_column("own key?")
        for client_id in sorted(keyset.allowlist):
            own = is_label_value(client_id) and client_id not in RESERVED_IDS
            table.add_row(client_id, "[green]yes[/]" if own else "[yellow]no: shared[/]")
        console.print(table)
    flags = Table(title="flags", title_justify="left")
    flags.add_column("flag")
    flags.add_column("value")
    for name, value in keyset_dict(keyset)["flags"].items():
        flags.add_row(name, "[green]on[/]" if value else "[red]off[/]")
    console.print(flags)
    if resolved:
        table = Table(title="resolution", title_justify="left")
        for column in ("client id", "bounded key", "kind"):
            table.add_column(column)
        for client_id, key in resolved.items():
            table.add_row(client_id, key["key"], key["kind"])
        console.print(table)
