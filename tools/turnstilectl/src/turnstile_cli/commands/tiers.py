"""``tiers``: validate a tier configuration with the one shared parser (SPEC T2).

Reads ``TURNSTILE_TIERS`` / ``TURNSTILE_DEFAULT_TIER`` like the services do, or
``--tiers`` / ``--default-tier``; the answer is what every service would make
of it, because they all call :func:`turnstile_platform.tiers.parse_tiers`.
"""

from __future__ import annotations

import argparse
import os

from rich.console import Console

from turnstile_cli.commands.base import Subparsers, command
from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import kv_table
from turnstile_platform.tiers import TierConfig, TierConfigError, parse_tiers


def register(sub: Subparsers) -> None:
    tiers = command(
        sub,
        "tiers",
        _tiers,
        help="validate a tier configuration (exit 1 when invalid)",
        description="Validate declared tiers and the default tier with the services' own "
        "parser. Without options, reads TURNSTILE_TIERS and TURNSTILE_DEFAULT_TIER.",
    )
    tiers.add_argument("--tiers", help="comma-separated tiers (default: $TURNSTILE_TIERS)")
    tiers.add_argument("--default-tier", help="(default: $TURNSTILE_DEFAULT_TIER)")


async def _tiers(args: argparse.Namespace, ctx: Context) -> int:
    tiers = args.tiers if args.tiers is not None else os.environ.get("TURNSTILE_TIERS")
    default = (
        args.default_tier
        if args.default_tier is not None
        else os.environ.get("TURNSTILE_DEFAULT_TIER")
    )
    try:
        config = parse_tiers(tiers, default)
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
        },
        lambda c: _render(c, config),
    )
    return Exit.OK


def _render(console: Console, config: TierConfig) -> None:
    if not config.enabled:
        console.print(
            "[bold green]✓ valid[/]: no tiers configured; placement does not filter by tier"
        )
        return
    console.print("[bold green]✓ valid[/]")
    console.print(
        kv_table({"declared": ", ".join(config.declared), "default": config.default or "-"})
    )
