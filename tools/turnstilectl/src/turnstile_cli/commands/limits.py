"""``limits``: per-key limits in Redis, read by admission's decision script.

Changes go through :class:`turnstile_clientkeys.limits.LimitsStore`, which
validates each document, straight to Redis (like ``keys``: the limits' source of
truth is Redis, and ``admit.lua`` reads them on every decision, so there is
nothing to reload). A key's limits only apply to clients that resolve to it:
setting them for an id that is not allowlisted (its clients share the shared
key) is allowed, and warned about.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_clientkeys import RESERVED_IDS, KeySetStore, Resolver
from turnstile_clientkeys.limits import CLUSTER, DEFAULT, LimitsError, LimitsStore, merge_patch
from turnstile_platform.redis_client import create_redis


async def _limits(args: argparse.Namespace, ctx: Context) -> int:
    url, prefix = ctx.redis_target(args.redis_url, args.redis_prefix)
    redis = create_redis(url, timeout_s=min(ctx.timeout_s, 5.0))
    try:
        store = LimitsStore(redis, prefix)
        try:
            field = _field(args)
            document = _document(args)
        except LimitsError as error:
            ctx.out.failure(str(error))
            return Exit.USAGE
        if args.verb == "show":
            return await _get(ctx, store, field)
        assert field is not None  # argparse requires one for every verb but show
        warning = None
        if args.key and args.verb != "delete":
            warning = await _not_in_effect(KeySetStore(redis, prefix), args.key)
            if warning:
                ctx.out.warning(warning)
        try:
            return await _change(ctx, store, args.verb, field, document, warning)
        except LimitsError as error:
            ctx.out.failure(f"{_name(field)}: {error}; nothing changed")
            return Exit.USAGE
    finally:
        await redis.aclose()


def _field(args: argparse.Namespace) -> str | None:
    if args.default:
        return DEFAULT
    if args.cluster:
        return CLUSTER
    return LimitsStore.field_of(args.key) if args.key else None


def _document(args: argparse.Namespace) -> Any:
    text = getattr(args, "document", None)
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise LimitsError(f"the document is not JSON: {error.msg} (column {error.colno})") from None


async def _get(ctx: Context, store: LimitsStore, field: str | None) -> int:
    if field is None:
        shown = await store.show()
        ctx.out.emit(shown, lambda console: _render_all(console, shown))
        return Exit.OK
    doc = await store.get(field)
    ctx.out.emit(
        {"field": field, "limits": doc},
        lambda console: console.print(
            f"{_name(field)}: "
            + (json.dumps(doc, sort_keys=True) if doc is not None else "none stored (defaults)")
        ),
    )
    return Exit.OK if doc is not None else Exit.ERROR


async def _change(
    ctx: Context,
    store: LimitsStore,
    verb: str,
    field: str,
    document: Any,
    warning: str | None = None,
) -> int:
    before = await store.get(field)
    if verb == "delete":
        removed = await store.delete(field)
        ctx.out.emit(
            {"field": field, "deleted": removed, "was": before},
            lambda console: console.print(
                f"[green]✓[/] deleted {_name(field)}'s limits (was {json.dumps(before)}): "
                "the defaults apply"
                if removed
                else f"{_name(field)} had no limits stored: nothing deleted"
            ),
        )
        return Exit.OK if removed else Exit.ERROR
    if verb == "patch":
        document = merge_patch(before or {}, document)
    stored = await store.put(field, document)
    replaced = verb == "set" and before is not None and before != stored

    def told(console: Console) -> None:
        console.print(f"[green]✓[/] {_name(field)}: {json.dumps(stored, sort_keys=True)}")
        if replaced:
            console.print(
                f"  replaced the whole document {json.dumps(before, sort_keys=True)}; "
                "fields it had and this one lacks now fall back to the defaults "
                "(use patch to change some fields only)"
            )

    payload: dict[str, Any] = {"field": field, "limits": stored, "was": before}
    if warning:
        payload["warning"] = warning
    ctx.out.emit(payload, told)
    return Exit.OK


async def _not_in_effect(keys: KeySetStore, key: str) -> str | None:
    """Why ``key``'s limits apply to no client (None: some resolve to it): a key's
    limits apply only to the clients that resolve to it."""
    if key in RESERVED_IDS:
        return None
    keyset = await keys.load()
    if Resolver(keyset).resolve_id(key).key == key:
        return None
    return (
        f"{key!r} is not allowlisted (key set v{keyset.version}): its clients use the "
        f"shared key, so these limits are not in effect until `turnstilectl keys allow {key}`"
    )


def _name(field: str) -> str:
    return field.removeprefix("key:") if field.startswith("key:") else f"the {field}"


def _render_all(console: Console, shown: dict[str, Any]) -> None:
    if not shown:
        console.print("no limits stored: every key has admission's default settings")
        return
    table = Table(title="stored limits", title_justify="left")
    for column in ("for", "cap", "rate", "burst", "concurrency"):
        table.add_column(column)
    for field, doc in shown.items():
        cells = [str(doc.get(name, "-")) for name in ("cap", "rate", "burst", "concurrency")]
        table.add_row(_name(field), *cells)
    console.print(table)
