"""``status``: is each service up (gRPC health), and where is it."""

from __future__ import annotations

import argparse
import asyncio

from rich.table import Table

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_platform.health_check import check


async def _status(args: argparse.Namespace, ctx: Context) -> int:
    targets = {
        "admission": ctx.targets.admission,
        "substrate": ctx.targets.substrate,
        "affinity": ctx.targets.affinity,
    }
    identities = {
        "admission": ctx.targets.admission_id,
        "substrate": ctx.targets.substrate_id,
        "affinity": ctx.targets.affinity_id,
    }

    async def one(name: str) -> str:
        credentials, options = ctx.credentials(targets[name], identities[name])
        return await check(
            targets[name],
            timeout_s=min(ctx.timeout_s, 2.0),
            credentials=credentials,
            options=options,
        )

    results = await asyncio.gather(*(one(name) for name in targets))
    statuses = dict(zip(targets, results, strict=True))

    def show(console: object) -> None:
        table = Table(title="turnstile services", title_justify="left")
        for column in ("service", "address", "health"):
            table.add_column(column)
        for name, status in statuses.items():
            style = "green" if status == "SERVING" else "red"
            table.add_row(name, targets[name], f"[{style}]{status}[/]")
        ctx.out.console.print(table)

    ctx.out.emit(
        {name: {"address": targets[name], "health": s} for name, s in statuses.items()}, show
    )
    return Exit.OK if all(s == "SERVING" for s in results) else Exit.RETRYABLE
