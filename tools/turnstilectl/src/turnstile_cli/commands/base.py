"""How a subcommand is declared: its parser, its handler, the service it talks to."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from turnstile_cli.context import Context

#: ``-o`` formats (``json`` is ``--json``).
OUTPUT_FORMATS = ("json", "yaml", "wide", "name")

Handler = Callable[[argparse.Namespace, "Context"], Awaitable[int]]
Subparsers = Any  # argparse's _SubParsersAction is private


def common_options(*, suppress: bool) -> argparse.ArgumentParser:
    """Options accepted before the subcommand and after it.

    The subcommand's copy defaults to SUPPRESS so that it only overrides the
    top-level value when given (``turnstilectl place s1 --json`` works too).
    """
    default = argparse.SUPPRESS
    parser = argparse.ArgumentParser(add_help=False)
    group = parser.add_argument_group("common options")
    group.add_argument(
        "--json",
        action="store_true",
        default=default if suppress else False,
        help="print one JSON object on stdout (errors too), for scripts",
    )
    group.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default=default if suppress else None,
        help="json (as --json), yaml, wide (tables never cut to the terminal's width) "
        "or name (the ids of what a command shows, one a line)",
    )
    group.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default=default if suppress else "auto",
        help="colour in human output (default: auto; NO_COLOR is honoured)",
    )
    group.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default if suppress else False,
        help="no line on stderr naming the stack the command acts on",
    )
    group.add_argument(
        "--stack",
        metavar="CHECKOUT",
        default=default if suppress else None,
        help="act on the stack of this checkout (or this stack.json); default: "
        "$TURNSTILE_STACK, else the checkout the command runs in (docs/cli.md)",
    )
    group.add_argument(
        "--trace",
        action="store_true",
        default=default if suppress else False,
        help="print the command's trace id on stderr (--json payloads always carry it)",
    )
    group.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        default=default if suppress else 10.0,
        help="deadline of each call (default: 10)",
    )
    for service, port in (("admission", 50051), ("substrate", 50052), ("affinity", 50053)):
        group.add_argument(
            f"--{service}",
            metavar="HOST:PORT",
            default=default if suppress else None,
            help=f"the {service} service (default: $TURNSTILE_{service.upper()}_ADDR "
            f"or 127.0.0.1:{port})",
        )
    for flag, what, variable in (
        ("cert", "client certificate", "TURNSTILE_TLS_CERT_FILE"),
        ("key", "its private key", "TURNSTILE_TLS_KEY_FILE"),
        ("ca", "CA bundle", "TURNSTILE_TLS_CA_FILE"),
    ):
        group.add_argument(
            f"--{flag}",
            metavar="FILE",
            default=default if suppress else None,
            help=f"mTLS {what} (default: ${variable}, else the local stack's in .run/tls)",
        )
    return parser


COMMON = common_options(suppress=True)


def command(
    subparsers: Subparsers,
    name: str,
    handler: str,
    *,
    help: str,
    service: str | None = None,
    description: str | None = None,
    formatter_class: type[argparse.HelpFormatter] = argparse.HelpFormatter,
) -> argparse.ArgumentParser:
    """Add a subcommand; ``service`` adds ``--target`` for that service's address.

    ``handler`` is ``"module:function"``, imported by :func:`load_handler` only when
    the command runs (so ``--help`` imports none of what commands need).
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name,
        help=help,
        description=description or help,
        parents=[COMMON],
        formatter_class=formatter_class,
    )
    parser.set_defaults(handler=handler, action=name, service=service)
    if service is not None:
        parser.add_argument(
            "--target",
            metavar="HOST:PORT",
            help=f"the {service} service's address (default: $TURNSTILE_{service.upper()}_ADDR "
            "or the local stack's)",
        )
    return parser


def verb(
    verbs: Subparsers, name: str, *, help: str, hidden: tuple[str, ...] = ()
) -> list[argparse.ArgumentParser]:
    """A resource's verb (``limits show``), taking the common options too, and
    its old names as hidden aliases (accepted, never listed: ``limits get``).
    Returns the parsers to declare its arguments on; each sets ``verb=name``."""
    parsers = [verbs.add_parser(name, help=help, description=help, parents=[COMMON])]
    # No ``help``: argparse then lists it nowhere (help, usage's choices, completion).
    parsers += [verbs.add_parser(old, description=help, parents=[COMMON]) for old in hidden]
    for parser in parsers:
        parser.set_defaults(verb=name)
    return parsers


def load_handler(reference: str) -> Handler:
    """The coroutine function ``"module:function"`` names."""
    module, _, name = reference.partition(":")
    return cast(Handler, getattr(importlib.import_module(module), name))


def queue_per_client_without_wait(args: argparse.Namespace, ctx: Context) -> bool:
    """``--queue-per-client`` without a ``--wait`` budget (``admit``, ``activate``):
    said, and the caller exits with a usage error (SPEC Q1: nothing to wait with)."""
    if args.queue_per_client and args.wait <= 0:
        ctx.out.failure("--queue-per-client needs a --wait budget")
        return True
    return False
