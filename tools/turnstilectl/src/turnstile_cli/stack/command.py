"""``up``: the local stack in the foreground (``./scripts/up`` runs it)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from turnstile_cli.commands.base import Subparsers, command
from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.stack.config import LOCAL_GRACE_S, LOCAL_TIERS, StackConfig
from turnstile_cli.stack.runner import Stack


def _triple(text: str) -> tuple[int, int, int]:
    try:
        a, s, f = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("give three ports: ADMISSION,SUBSTRATE,AFFINITY") from None
    for port in (a, s, f):
        if not 0 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"{port} is not a port")
    return a, s, f


def register(sub: Subparsers) -> None:
    up = command(
        sub,
        "up",
        _up,
        help="run the local stack (no Docker, no Kubernetes) until Ctrl-C",
        description="Apply migrations, start admission, substrate (Direct) and affinity as "
        "local processes, wait until each is SERVING, stream their logs, and stop "
        "everything on Ctrl-C or SIGTERM. Redis and PostgreSQL must answer "
        "(./scripts/up starts them).",
    )
    env = os.environ.get
    up.add_argument("--redis-url", default=env("TURNSTILE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    up.add_argument("--redis-prefix", default=env("TURNSTILE_REDIS_PREFIX", "turnstile:"))
    up.add_argument(
        "--database-url",
        default=env("TURNSTILE_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/turnstile"),
        help="created when missing (default: $TURNSTILE_DATABASE_URL or the local "
        "server's `turnstile` database)",
    )
    up.add_argument("--grpc-ports", type=_triple, default=(50051, 50052, 50053), metavar="A,S,F")
    up.add_argument(
        "--metrics-ports",
        type=_triple,
        default=(9091, 9092, 9093),
        metavar="A,S,F",
        help="Prometheus ports (0 turns one off)",
    )
    up.add_argument(
        "--tiers",
        default=env("TURNSTILE_TIERS", LOCAL_TIERS),
        help=f"declared tiers (default: {LOCAL_TIERS})",
    )
    up.add_argument("--default-tier", default=env("TURNSTILE_DEFAULT_TIER", ""))
    up.add_argument(
        "--grace",
        type=float,
        default=float(env("TURNSTILE_GRACE_S", str(LOCAL_GRACE_S))),
        help=f"affinity grace period in seconds (local default {LOCAL_GRACE_S:g}; production 60)",
    )
    up.add_argument(
        "--state-dir",
        type=Path,
        default=Path(env("TURNSTILE_DIRECT_STATE_DIR", ".run/direct")),
        help="where the Direct substrate keeps runtimes' workspaces and logs",
    )
    up.add_argument("--log-level", default=env("TURNSTILE_LOG_LEVEL", "INFO"))
    up.add_argument(
        "--startup-timeout", type=float, default=60.0, help="seconds to wait for SERVING"
    )
    up.add_argument(
        "--stop-grace",
        type=float,
        default=15.0,
        help="seconds a service gets after SIGTERM before SIGKILL",
    )


async def _up(args: argparse.Namespace, ctx: Context) -> int:
    config = StackConfig(
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        database_url=args.database_url,
        ports=args.grpc_ports,
        metrics_ports=args.metrics_ports,
        tiers=args.tiers,
        default_tier=args.default_tier,
        grace_s=args.grace,
        state_dir=args.state_dir,
        log_level=args.log_level,
    )
    stack = Stack(
        config,
        ctx.out.console,
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
    )
    code = await stack.run()
    return Exit.OK if code == 0 else Exit.ERROR
