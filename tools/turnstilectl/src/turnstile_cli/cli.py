"""The ``turnstilectl`` command line: parse, dispatch, turn errors into exit codes.

Parsing needs only :mod:`turnstile_cli.parser` (argparse); the chosen command's
module, and grpc, protobuf, rich or Redis with it, is imported after parsing.
That keeps ``--help`` and usage errors instant and a command's start-up to what
it uses (``tools/turnstilectl/bench/cli_startup.py`` measures both).

Every command but ``up``, ``completion`` and ``tiers`` acts on a target chosen
explicitly (:mod:`turnstile_cli.target`, SPEC M2) and names it on stderr first
(``-q`` keeps it quiet). One rule for every command: usage errors exit 2 with one
line and a hint on stderr (JSON on stdout under ``--json``),
refusals 3, retryable failures 4, certificate problems 5
(:mod:`turnstile_cli.exits`). Every command is one trace: a root span around
the whole command, so its RPCs (``place --release`` makes two) are children of
it; ``--trace`` prints its id on stderr and ``--json`` payloads carry it as
``trace_id``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from turnstile_cli.exits import Exit
from turnstile_cli.parser import build_parser

if TYPE_CHECKING:
    from turnstile_cli.context import Context

__all__ = ["build_parser", "run"]

#: Commands that make no RPC and so start no trace (``up`` runs the stack; the
#: demo starts one trace per step itself; ``traces`` reads the stack's span log).
UNTRACED = frozenset({"up", "demo", "tiers", "traces"})


#: Commands that act on no stack (``up`` is one; ``tiers`` checks a configuration).
NO_TARGET = frozenset({"up", "completion", "tiers"})

#: Commands that act on Redis: a Redis prefix given names what they change.
REDIS_COMMANDS = frozenset({"keys", "limits"})


def run(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code."""
    from turnstile_cli.parser import parse

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parse(parser, argv)
    if args.action == "completion":  # no RPC, no output machinery: a script on stdout
        from turnstile_cli.completion import script

        sys.stdout.write(script(args.shell, parser))
        return Exit.OK
    if args.action != "up":  # the services ``up`` starts keep their gRPC log
        # gRPC core logs a failed handshake on stderr (ssl_transport_security.cc …);
        # the CLI explains it in one line instead (turnstile_cli.transport). Read
        # when grpc is first imported, which is below.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import asyncio

    from turnstile_cli.context import ClientTls, Context, Targets
    from turnstile_cli.output import Output
    from turnstile_cli.target import Target, TargetError, resolve

    color = {"always": True, "never": False}.get(args.color)
    if color is None and os.environ.get("NO_COLOR"):
        color = False
    out = Output(output=args.output or ("json" if args.json else None), color=color)
    target: Target | None = None
    if args.action not in NO_TARGET:
        redis_explicit = args.action in REDIS_COMMANDS and bool(
            getattr(args, "redis_prefix", None) or os.environ.get("TURNSTILE_REDIS_PREFIX")
        )
        try:
            target = resolve(args, redis_explicit=redis_explicit)
        except TargetError as error:
            out.failure(
                str(error),
                code="UNAVAILABLE" if error.exit_code == Exit.RETRYABLE else "INVALID_ARGUMENT",
                reason=error.reason,
                extra={"stacks": [_listed(s) for s in error.stacks]} if error.stacks else None,
            )
            return error.exit_code
        if not args.quiet and args.action != "status":  # status leads with it itself
            out.target(target.describe())
    stack = target.stack if target is not None else None
    targets = Targets.resolve(args.admission, args.substrate, args.affinity, stack=stack)
    if getattr(args, "service", None) and getattr(args, "target", None):
        from dataclasses import replace

        targets = replace(targets, **{args.service: args.target})
    tls = ClientTls.resolve(
        args.cert, args.key, args.ca, stack=stack if targets.reach(stack) else None
    )
    ctx = Context(
        out=out, targets=targets, timeout_s=args.timeout, tls=tls, stack=stack, target=target
    )
    watch = getattr(args, "watch", None)
    try:
        return asyncio.run(_watch(args, ctx, watch) if watch else _dispatch(args, ctx))
    except KeyboardInterrupt:
        return Exit.OK if watch else 130  # Ctrl-C is how a watch ends


def _listed(stack: object) -> dict[str, object]:
    from turnstile_cli.context import LocalStack

    assert isinstance(stack, LocalStack)
    return {
        "checkout": str(stack.checkout) if stack.checkout else None,
        "stack_file": str(stack.path),
        "addresses": stack.addresses,
    }


async def _watch(args: argparse.Namespace, ctx: Context, every_s: float) -> int:
    """Run the command again every ``every_s`` until Ctrl-C or SIGTERM, as
    ``watch`` does: a person sees the screen redrawn under a header, a script one
    JSON object a line. A failed round is shown and the next one runs all the
    same. SIGTERM ends it at once, between rounds or in one (exit 0, as Ctrl-C)."""
    import asyncio
    import signal
    import time

    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopped.set)
    stop = asyncio.ensure_future(stopped.wait())
    try:
        while not stopped.is_set():
            if not ctx.out.json_mode:
                ctx.out.console.clear()
                ctx.out.console.print(
                    f"[dim]every {every_s:g} s: turnstilectl {args.action} · "
                    f"{time.strftime('%H:%M:%S')} · Ctrl-C stops[/]"
                )
            round_ = asyncio.ensure_future(_dispatch(args, ctx))
            await asyncio.wait({round_, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not round_.done():
                round_.cancel()
                await asyncio.gather(round_, return_exceptions=True)
                break
            round_.result()
            await asyncio.wait({stop}, timeout=every_s)
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        stop.cancel()
    return Exit.OK


async def _dispatch(args: argparse.Namespace, ctx: Context) -> int:
    if args.action in UNTRACED:
        return await _handle(args, ctx)
    import asyncio

    from opentelemetry import trace

    from turnstile_platform import tracing

    exported = tracing.exporter_configured()
    failures = tracing.quiet_export_failures() if exported else None
    provider = tracing.create_tracer_provider("turnstilectl", short_lived=True)
    ctx.tracer_provider = provider
    ctx.client_spans = exported
    tracer = provider.get_tracer("turnstile_cli")
    try:
        with tracer.start_as_current_span(f"turnstilectl {args.action}") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            ctx.out.trace_id = trace_id
            if args.trace and not ctx.out.json_mode:
                print(f"trace {trace_id}", file=sys.stderr)
            code = await _handle(args, ctx)
            if code != Exit.OK:
                span.set_status(trace.StatusCode.ERROR, f"exit {code}")
            return code
    finally:
        # Bounded by the exporter's own timeout (short_lived): a collector that is
        # not there costs one refused connection, not the SDK's 10 s of retries.
        if exported:
            await asyncio.to_thread(provider.force_flush)
        provider.shutdown()
        if failures is not None and failures.count:
            print(
                f"turnstilectl: the command's trace was not exported (no OTLP collector "
                f"answered at {tracing.exporter_endpoint()} within "
                f"{tracing.SHORT_LIVED_EXPORT_TIMEOUT_S:g} s)",
                file=sys.stderr,
            )


async def _handle(args: argparse.Namespace, ctx: Context) -> int:
    import grpc.aio

    from turnstile_cli import exits
    from turnstile_cli.commands.base import load_handler
    from turnstile_client import TurnstileError, decode

    handler = load_handler(args.handler)
    try:
        code: int = await handler(args, ctx)
    except (grpc.aio.AioRpcError, TurnstileError) as error:
        # Raw stubs raise the first, the typed client (turnstile_client) the second.
        rich = error if isinstance(error, TurnstileError) else decode(error)
        if rich.code == grpc.StatusCode.UNAVAILABLE and not rich.reason:
            from turnstile_cli.transport import explain

            problem = explain(
                rich.message, ctx.tls, ctx.targets, service=getattr(args, "service", None)
            )
            if problem is not None:
                ctx.out.failure(problem.text, code="UNAVAILABLE", reason=problem.kind)
                return Exit.TRANSPORT
        ctx.out.rpc_error(rich, action=args.action)
        return exits.for_error(rich)
    except exits.UsageError as error:
        ctx.out.failure(str(error))
        return Exit.USAGE
    except Exception as error:
        known = exits.known_failure(error)
        if known is None:
            raise
        text, code = known
        ctx.out.failure(text)
        return code
    return code
