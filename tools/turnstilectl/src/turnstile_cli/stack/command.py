"""``up``: the local stack in the foreground (``./scripts/up`` runs it)."""

from __future__ import annotations

import argparse

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.stack.config import StackConfig, checkout_database_url, checkout_prefix
from turnstile_cli.stack.runner import Stack


def config_from_args(args: argparse.Namespace) -> StackConfig:
    """The stack ``up`` runs: what was given, and for the rest this checkout's own
    Redis prefix and database, and the default ports (moved at start when taken)."""
    defaults = StackConfig()
    defaulted = {
        name
        for name, given in (
            ("grpc", args.grpc_ports),
            ("metrics", args.metrics_ports),
            ("prometheus", args.prometheus_port),
        )
        if given is None
    }
    return StackConfig(
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix or checkout_prefix(args.state_dir),
        database_url=args.database_url or checkout_database_url(args.state_dir),
        ports=args.grpc_ports or defaults.ports,
        metrics_ports=args.metrics_ports or defaults.metrics_ports,
        tiers=args.tiers,
        default_tier=args.default_tier,
        grace_s=args.grace,
        state_dir=args.state_dir,
        log_level=args.log_level,
        prometheus_port=(
            defaults.prometheus_port if args.prometheus_port is None else args.prometheus_port
        ),
        prometheus_scrape_s=args.prometheus_scrape_interval,
        tls_dir=None if args.plaintext else args.tls_dir,
        pick_free=frozenset(defaulted),
    )


async def _up(args: argparse.Namespace, ctx: Context) -> int:
    if args.reset:
        from turnstile_cli.stack import reset

        return await reset.run(args, ctx.out)
    if args.yes:
        ctx.out.failure("--yes goes with --reset")
        return Exit.USAGE
    config = config_from_args(args)
    stack = Stack(
        config,
        ctx.out.console,
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
        prune_after_s=args.prune_after * 3600,
    )
    code = await stack.run()
    return Exit.OK if code == 0 else Exit.ERROR
