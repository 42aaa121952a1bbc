"""``up``: the local stack in the foreground (``./scripts/up`` runs it)."""

from __future__ import annotations

import argparse

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.stack.config import StackConfig, checkout_prefix
from turnstile_cli.stack.runner import Stack


async def _up(args: argparse.Namespace, ctx: Context) -> int:
    config = StackConfig(
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix or checkout_prefix(args.state_dir),
        database_url=args.database_url,
        ports=args.grpc_ports,
        metrics_ports=args.metrics_ports,
        tiers=args.tiers,
        default_tier=args.default_tier,
        grace_s=args.grace,
        state_dir=args.state_dir,
        log_level=args.log_level,
        prometheus_port=args.prometheus_port,
        prometheus_scrape_s=args.prometheus_scrape_interval,
        tls_dir=None if args.plaintext else args.tls_dir,
    )
    stack = Stack(
        config,
        ctx.out.console,
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
        prune_after_s=args.prune_after * 3600,
    )
    code = await stack.run()
    return Exit.OK if code == 0 else Exit.ERROR
