"""``tiers``: validate a tier configuration with the one shared parser (SPEC T2).

Reads ``TURNSTILE_TIERS`` / ``TURNSTILE_DEFAULT_TIER`` like the services do, or
``--tiers`` / ``--default-tier``; the answer is what every service would make
of it, because they all call :func:`turnstile_platform.tiers.parse_tiers`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import kv_table
from turnstile_cli.stack import state
from turnstile_platform.tiers import TierConfig, TierConfigError, parse_tiers


async def _tiers(args: argparse.Namespace, ctx: Context) -> int:
    tiers = args.tiers if args.tiers is not None else os.environ.get("TURNSTILE_TIERS")
    default = (
        args.default_tier
        if args.default_tier is not None
        else os.environ.get("TURNSTILE_DEFAULT_TIER")
    )
    source = "command line" if args.tiers is not None else "environment"
    if tiers is None:
        running = _described()
        if running is not None:
            path, description = running
            tiers = str(description.get("tiers", ""))
            if default is None:
                default = str(description.get("default_tier", ""))
            source = f"the running local stack ({path})"
        else:
            source = "environment (unset; no running local stack found)"
    try:
        config = parse_tiers(tiers, default, os.environ.get("TURNSTILE_TIER_SETTINGS"))
    except TierConfigError as error:
        field = error.field
        message = str(error).removeprefix(f"{field}: ")
        ctx.out.emit(
            {"valid": False, "field": field, "error": message},
            lambda c: c.print(
                f"[bold red]✗ invalid[/] [bold]TURNSTILE_{field.upper()}[/]: {message}"
            ),
        )
        return Exit.ERROR
    ctx.out.emit(
        {
            "valid": True,
            "declared": list(config.declared),
            "default": config.default,
            "enabled": config.enabled,
            "source": source,
        },
        lambda c: _render(c, config, source),
    )
    return Exit.OK


def _render(console: Console, config: TierConfig, source: str) -> None:
    console.print(f"[dim]from {source}[/]")
    if not config.enabled:
        console.print(
            "[bold green]✓ valid[/]: no tiers configured; placement does not filter by tier"
        )
        return
    console.print("[bold green]✓ valid[/]")
    console.print(
        kv_table({"declared": ", ".join(config.declared), "default": config.default or "-"})
    )


def _described() -> tuple[Path, dict[str, object]] | None:
    """The description of the stack this command is about (SPEC M2): the one
    ``TURNSTILE_STACK`` (``_FILE``) names, else this checkout's ``.run/stack.json``
    (read even when its stack has stopped: its tiers are still what it ran with),
    never the user's copy of another checkout's."""
    from turnstile_cli.target import STACK_VARIABLES, checkout_here

    named = next((os.environ[v] for v in STACK_VARIABLES if os.environ.get(v)), None)
    if named is not None:
        path = Path(named)
        file = path if path.suffix == ".json" or path.is_file() else path / ".run" / state.FILE_NAME
    else:
        found = checkout_here()
        if found is None:
            return None
        file = found[0] / ".run" / state.FILE_NAME
    data = state.read(file)
    return (file, data) if data is not None else None
