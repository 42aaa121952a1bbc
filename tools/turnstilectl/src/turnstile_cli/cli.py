"""The ``turnstilectl`` command line: parse, dispatch, turn errors into exit codes."""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import replace

import grpc.aio
from pydantic import ValidationError
from redis.exceptions import RedisError

from turnstile_cli import exits
from turnstile_cli.commands import admission, affinity, keys, status, substrate, tiers
from turnstile_cli.commands.base import common_options
from turnstile_cli.context import Context, Targets
from turnstile_cli.exits import Exit
from turnstile_cli.output import Output
from turnstile_platform.errors import decode

EPILOG = """\
exit codes: 0 ok · 1 error · 2 usage or invalid request · 3 refused by a limit ·
4 retryable (pending, busy, unavailable). See docs/cli.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnstilectl",
        description="Turnstile's command line: admit, activate, place, and see what is where.",
        epilog=EPILOG,
        parents=[common_options(suppress=False)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Imported here: the stack and the demo pull in process and tracing machinery
    # that the RPC commands do not need.
    from turnstile_cli import demo
    from turnstile_cli.stack import command as stack

    for module in (admission, substrate, affinity, keys, tiers, status, stack, demo):
        module.register(sub)
    return parser


def run(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    color = {"always": True, "never": False}.get(args.color)
    if color is None and os.environ.get("NO_COLOR"):
        color = False
    out = Output(json_mode=args.json, color=color)
    targets = Targets.resolve(args.admission, args.substrate, args.affinity)
    if getattr(args, "service", None) and getattr(args, "target", None):
        targets = replace(targets, **{args.service: args.target})
    if not 0 < args.timeout <= 120:
        out.failure("--timeout must be between 0 and 120 seconds")
        return Exit.USAGE
    ctx = Context(out=out, targets=targets, timeout_s=args.timeout)
    try:
        return asyncio.run(_dispatch(args, ctx))
    except KeyboardInterrupt:
        return 130


async def _dispatch(args: argparse.Namespace, ctx: Context) -> int:
    try:
        code: int = await args.handler(args, ctx)
    except grpc.aio.AioRpcError as error:
        rich = decode(error)
        ctx.out.rpc_error(rich, action=args.action)
        return exits.for_error(rich)
    except ValidationError as error:
        ctx.out.failure(f"invalid TURNSTILE_* setting: {error}")
        return Exit.USAGE
    except RedisError as error:
        ctx.out.failure(f"Redis: {error}")
        return Exit.RETRYABLE
    return code
