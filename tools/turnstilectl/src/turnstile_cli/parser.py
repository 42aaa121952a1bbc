"""Every subcommand's arguments, declared without importing what the commands run.

``turnstilectl --help`` and argument errors need only :mod:`argparse`; the module
that runs a command (and grpc, protobuf, rich, Redis with it) is imported by
:func:`turnstile_cli.cli.run` only for the one command chosen. A handler is named
``"module:function"`` here; ``tools/turnstilectl/bench/cli_startup.py`` measures
what this buys.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import NoReturn

from turnstile_cli.clients import add_client_options, bounded_key, client_filter, client_id
from turnstile_cli.commands.base import Subparsers, command, common_options, verb
from turnstile_cli.stack.defaults import LOCAL_GRACE_S, LOCAL_TIERS

EPILOG = """\
exit codes: 0 ok · 1 error · 2 usage or invalid request · 3 refused by a limit ·
4 retryable (pending, busy, unavailable) · 5 a certificate or TLS problem.
Shell completion: eval "$(turnstilectl completion bash)" (or zsh). See docs/cli.md.
"""

#: ``admit --kind`` values (mapped to ``ActivationKind`` by the command).
ADMIT_KINDS = ("cold", "restore", "resume", "warm")

DEMO_DESCRIPTION = (
    "Tell a short story against the running local stack: two tiers, a concurrency "
    "limit, a rate refusal, sticky sessions, a killed worker and a fallback with a "
    "workspace reset, each step one trace."
)


class CommandLineError(Exception):
    """A command line that cannot be parsed: ``message`` in one line, ``prog`` the
    (sub)command it is about (its ``--help`` is the hint)."""

    def __init__(self, message: str, prog: str) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse, with "did you mean" for a mistyped command or choice (every
    subcommand's parser is one too: argparse makes them of the parent's class),
    and errors raised for :func:`parse` to tell in one line."""

    def error(self, message: str) -> NoReturn:
        found = _INVALID_CHOICE.search(message)
        if found is not None:
            typed, choices = found.group(1), _CHOICE.findall(found.group(2))
            close = _close(typed, choices)
            if close:
                # "… invalid choice: 'activte'" without the long list, and the guess.
                message = message[: found.end(1) + 1]
                message += " — did you mean " + " or ".join(repr(c) for c in close) + "?"
        raise CommandLineError(message, self.prog)


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")
_CHOICE = re.compile(r"'([^']*)'")
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def _close(typed: str, choices: list[str], *, n: int = 3, cutoff: float = 0.6) -> list[str]:
    import difflib

    return difflib.get_close_matches(typed, choices, n=n, cutoff=cutoff)


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed, or exit 2 with one line and a hint on stderr (the usage
    block only with ``--help``), or ``{"error": …}`` on stdout under ``--json``
    or ``-o json``. A mistyped option gets a guess, as a mistyped command does."""
    try:
        _check_options(parser, argv)
        args = parser.parse_args(argv)
        if not 0 < args.timeout <= 120:
            raise CommandLineError("--timeout must be between 0 and 120 seconds", parser.prog)
        return args
    except CommandLineError as error:
        _report(error, json_mode=_wants_json(argv))
        raise SystemExit(2) from None


def _wants_json(argv: list[str]) -> bool:
    for index, word in enumerate(argv):
        if word == "--":
            break
        if word == "--json" or word in ("-ojson", "--output=json"):
            return True
        if word in ("-o", "--output") and argv[index + 1 : index + 2] == ["json"]:
            return True
    return False


def _report(error: CommandLineError, *, json_mode: bool) -> None:
    import json
    import sys

    message = str(error)
    hint = f"see: {error.prog} --help"
    if json_mode:
        payload = {
            "error": {
                "code": "INVALID_ARGUMENT",
                "reason": "USAGE",
                "message": message,
                "hint": hint,
            }
        }
        sys.stdout.write(json.dumps(payload, sort_keys=True) + "\n")
    else:
        sys.stderr.write(f"{error.prog}: error: {message}\n{hint}\n")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _check_options(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuse an option the command (or its verb) does not take before argparse
    sees it: argparse would first complain of a required option missing (``usage
    --clinet acme``) or hand it to the top-level parser's usage (``activate
    --dryrun``). Values of options that take one are skipped, and so are
    negative numbers and everything after ``--``."""
    current = parser
    known = _options(parser)
    words = iter(argv)
    for word in words:
        if word == "--":
            return
        if word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.match(word):
            name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
            action = known.get(name) or _abbreviated(name, known)
            if action is None:
                options = sorted({o for o in known if o.startswith("--")})
                close = _close(name, options, n=2, cutoff=0.75)
                guess = " — did you mean " + " or ".join(close) + "?" if close else ""
                raise CommandLineError(f"unrecognized option {name}{guess}", current.prog)
            takes_value = action.nargs != 0 and not isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)
            )
            inline = "=" in word if word.startswith("--") else len(word) > 2
            if takes_value and not inline:
                if action.nargs == "?":
                    continue  # ``--watch [SECONDS]``: a positional may follow
                next(words, None)
            continue
        inner = _subparsers(current)
        if inner and word in inner:
            current = inner[word]
            known = {**known, **_options(current)}


def _abbreviated(name: str, known: dict[str, argparse.Action]) -> argparse.Action | None:
    """argparse's unique-prefix match of a long option (``--dry`` is ``--dry-run``)."""
    if not name.startswith("--"):
        return None
    matches = {known[o] for o in known if o.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


def add_watch(parser: argparse.ArgumentParser) -> None:
    """``--watch [SECONDS]`` on a listing: show it again every SECONDS until Ctrl-C."""
    parser.add_argument(
        "-w",
        "--watch",
        nargs="?",
        type=_interval,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="show it again every SECONDS (default 2) until Ctrl-C; with --json, one object a line",
    )


def add_queue_per_client(parser: argparse.ArgumentParser) -> None:
    """``--queue-per-client`` (SPEC Q1), for ``admit`` and ``activate``."""
    parser.add_argument(
        "--queue-per-client",
        action="store_true",
        help="with --wait: wait too when only the client's own limits refuse (its cap, "
        "concurrency or bucket), first come first served among its waiting calls",
    )


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{value:g} is not between 0.1 and 3600 seconds")
    return value


def non_negative(text: str) -> int:
    """An ``int`` of at least 0 (``--limit``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative (0 means all)")
    return value


def _duration(text: str) -> float:
    from turnstile_cli.commands.decisions import duration_s

    return duration_s(text)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="turnstilectl",
        description="Turnstile's command line: admit, activate, place, and see what is where.",
        epilog=EPILOG,
        parents=[common_options(suppress=False)],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for declare in (
        _admission,
        _substrate,
        _affinity,
        _keys,
        _limits,
        _tiers,
        _status,
        _traces,
        _stack,
        _demo,
        _completion,
    ):
        declare(sub)
    return parser


def _completion(sub: Subparsers) -> None:
    completion = command(
        sub,
        "completion",
        "turnstile_cli.completion:script",
        help="print a shell completion script (bash or zsh)",
        description='Print a completion script made from this parser: eval "$(turnstilectl '
        'completion bash)" in ~/.bashrc, or eval "$(turnstilectl completion zsh)" in '
        "~/.zshrc after compinit.",
    )
    completion.add_argument("shell", choices=("bash", "zsh"))


def _triple(text: str) -> tuple[int, int, int]:
    try:
        a, s, f = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("give three ports: ADMISSION,SUBSTRATE,AFFINITY") from None
    for port in (a, s, f):
        if not 0 <= port <= 65535:
            raise argparse.ArgumentTypeError(f"{port} is not a port")
    return a, s, f


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0}


def duration(text: str) -> float:
    """Seconds from ``30s``, ``500ms``, ``2m`` or a bare number of seconds."""
    number, unit = text, "s"
    for suffix in ("ms", "s", "m"):
        if text.endswith(suffix):
            number, unit = text[: -len(suffix)], suffix
            break
    try:
        value = float(number) * _DURATION_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text} is not a duration (30s, 500ms, 2m)") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a duration (30s, 500ms, 2m)")
    return value


def _admission(sub: Subparsers) -> None:
    admit = command(
        sub,
        "admit",
        "turnstile_cli.commands.admission:_admit",
        service="admission",
        help="ask admission whether a client may activate a sandbox now (takes a hold)",
    )
    admit.add_argument("sandbox_id")
    add_client_options(admit, forms=("client", "native", "unattributed"))
    admit.add_argument("--kind", choices=ADMIT_KINDS, default="cold", help="default: cold")
    admit.add_argument("--tier", default="", help="the sandbox's tier (informational)")
    admit.add_argument(
        "--node", action="append", default=[], help="a candidate node (repeat); checks node slots"
    )
    admit.add_argument(
        "--wait",
        type=duration,
        default=0.0,
        metavar="DURATION",
        help="wait up to DURATION in the fair queue when only the cluster bucket or node slots "
        "refuse (says its position and estimated wait on stderr as they change, and where it "
        "joined)",
    )
    add_queue_per_client(admit)
    admit.add_argument(
        "--commit", action="store_true", help="commit the hold at once (as a finished activation)"
    )
    admit.add_argument(
        "--cancel",
        action="store_true",
        help="cancel the hold at once (takes a hold, then gives it back)",
    )
    admit.add_argument(
        "--dry-run",
        action="store_true",
        help="decide and report without changing anything: no hold, nothing logged (SPEC Q4)",
    )

    hold = command(
        sub,
        "hold",
        "turnstile_cli.commands.admission:_hold",
        service="admission",
        help="commit or cancel a hold",
    )
    hold.add_argument("verb", choices=("commit", "cancel"))
    hold.add_argument("hold_id")

    usage = command(
        sub,
        "usage",
        "turnstile_cli.commands.admission:_usage",
        service="admission",
        help="a client's bounded key: live, pending, tokens, in flight",
    )
    add_client_options(usage, forms=("client", "native", "unattributed"))

    why = command(
        sub,
        "why",
        "turnstile_cli.commands.decisions:_why",
        service="admission",
        help="a sandbox's last activations and what decided each, in plain words",
        description="Read the decision log (SPEC Q3) for one sandbox: its last activations, "
        "newest first, what decided each (the refusing limit, its current value), the "
        "shadow limits that would have refused, and the trace id to look up.",
    )
    why.add_argument("sandbox_id")
    why.add_argument(
        "--client",
        metavar="ID",
        type=client_id,
        help="the sandbox's client (required of a tenant identity)",
    )
    why.add_argument("--last", type=int, default=5, metavar="N", help="how many (default: 5)")

    decisions = command(
        sub,
        "decisions",
        "turnstile_cli.commands.decisions:_decisions",
        service="admission",
        help="the decision log: every decision, newest first (or --follow)",
        description="List the decision log (SPEC Q3). With --follow, keep printing new "
        "entries oldest first; with -o json, one JSON object a line (for a log shipper).",
    )
    decisions.add_argument(
        "--client", metavar="ID", type=client_id, help="only this client's decisions"
    )
    decisions.add_argument("--sandbox", metavar="ID", help="only this sandbox's decisions")
    decisions.add_argument(
        "--since",
        type=_duration,
        metavar="AGE",
        help="only decisions this recent: 90s, 10m, 2h, 1d",
    )
    decisions.add_argument(
        "--limit", type=int, default=50, metavar="N", help="how many (default: 50)"
    )
    decisions.add_argument("--follow", "-f", action="store_true", help="keep printing new ones")
    decisions.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often --follow asks for new ones (default: 1)",
    )
    decisions.add_argument(
        "--polls", type=int, default=0, metavar="N", help="stop --follow after N polls (0: never)"
    )


def _substrate(sub: Subparsers) -> None:
    activate = command(
        sub,
        "activate",
        "turnstile_cli.commands.substrate:_activate",
        service="substrate",
        help="make a sandbox's runtime exist (admission decides first)",
    )
    activate.add_argument("sandbox_id")
    add_client_options(activate, forms=("client", "inherit", "native"))
    activate.add_argument("--tier", default="", help="tier of a new sandbox (empty: the default)")
    activate.add_argument(
        "--wait",
        type=duration,
        default=0.0,
        metavar="DURATION",
        help="wait up to DURATION (30s, 500ms, 2m) in admission's fair queue when the "
        "cluster is contended, instead of being refused (says its position and estimated "
        "wait on stderr as they change)",
    )
    add_queue_per_client(activate)
    activate.add_argument(
        "--dry-run",
        action="store_true",
        help="decide and report without changing anything: no runtime, record or hold",
    )

    deactivate = command(
        sub,
        "deactivate",
        "turnstile_cli.commands.substrate:_deactivate",
        service="substrate",
        help="stop a sandbox's runtime",
    )
    deactivate.add_argument("sandbox_id")

    sandboxes = command(
        sub,
        "sandboxes",
        "turnstile_cli.commands.substrate:_sandboxes",
        service="substrate",
        help="list sandboxes (newest first), or show one",
    )
    sandboxes.add_argument("sandbox_id", nargs="?", help="show this sandbox only")
    sandboxes.add_argument(
        "--client", metavar="ID", type=client_filter, default="", help="only this client's"
    )
    sandboxes.add_argument(
        "--limit", type=non_negative, default=100, help="at most this many (default 100; 0 for all)"
    )
    add_watch(sandboxes)
    sandboxes.add_argument(
        "--page-token",
        default="",
        metavar="TOKEN",
        help="go on from where a listing stopped (its next_page_token)",
    )


def _affinity(sub: Subparsers) -> None:
    place = command(
        sub,
        "place",
        "turnstile_cli.commands.affinity:_place",
        service="affinity",
        help="which sandbox serves this session's next turn (takes a lease)",
    )
    place.add_argument("session_id")
    place.add_argument(
        "--client",
        required=True,
        type=client_id,
        help="the client the session belongs to (SPEC O2): only its sandboxes serve it",
    )
    place.add_argument("--tier", default="", help="the session's tier (default tier if empty)")
    place.add_argument(
        "--release", action="store_true", help="release the lease at once (just look)"
    )

    release = command(
        sub,
        "release",
        "turnstile_cli.commands.affinity:_release",
        service="affinity",
        help="release a lease taken by place",
    )
    release.add_argument("sandbox_id")
    release.add_argument("lease_id")
    release.add_argument(
        "--client",
        type=client_filter,
        default="",
        help="the client it was placed for (default: whoever)",
    )

    sessions = command(
        sub,
        "sessions",
        "turnstile_cli.commands.affinity:_sessions",
        service="affinity",
        help="where sessions are placed",
    )
    sessions.add_argument("session_id", nargs="+")
    sessions.add_argument(
        "--client",
        required=True,
        type=client_id,
        help="the client the sessions belong to (SPEC O2)",
    )
    add_watch(sessions)

    prepare = command(
        sub,
        "prepare",
        "turnstile_cli.commands.affinity:_prepare",
        service="affinity",
        help="wake this session's sandbox ahead of its turn, if it is away (no lease)",
    )
    prepare.add_argument("session_id")
    prepare.add_argument(
        "--client",
        required=True,
        type=client_id,
        help="the client the session belongs to (SPEC O2)",
    )

    workers = command(
        sub,
        "workers",
        "turnstile_cli.commands.affinity:_workers",
        service="affinity",
        help="workers present, with their load",
    )
    workers.add_argument("--tier", default="", help="only this tier's")
    workers.add_argument(
        "--client", type=client_filter, default="", help="only the sandboxes this client owns"
    )
    add_watch(workers)


def _keys(sub: Subparsers) -> None:
    keys = command(
        sub,
        "keys",
        "turnstile_cli.commands.keys:_keys",
        service="admission",
        help="show or change the key set (allowlist + flags), through admission's admin API",
    )
    verbs = keys.add_subparsers(dest="verb", metavar="VERB", required=True)
    for show in verb(verbs, "show", help="the key set; with ids, what each resolves to"):
        # Any text: ``show 'bad id!'`` says it resolves to the shared key.
        show.add_argument("client_id", nargs="*", metavar="ID")
    for allow in verb(verbs, "allow", help="give client ids a bucket of their own"):
        allow.add_argument("client_id", nargs="+", type=client_id, metavar="ID")
    for remove in verb(verbs, "remove", help="send client ids back to the shared key"):
        # Any text: an entry an older version allowed is taken out as it is.
        remove.add_argument("client_id", nargs="+", metavar="ID")
    for flags in verb(verbs, "flags", help="show flags, or set NAME=on|off"):
        flags.add_argument("assignment", nargs="*", metavar="NAME=on|off")


LIMITS_DESCRIPTION = """\
Per-key limits, through admission's admin API (operators only; every change is
validated and recorded in the decision log). admit.lua reads them itself: a
change applies to the next decision on every replica. A document names any of
cap, rate, burst, concurrency, weight, level (platform, interactive, batch) and
shadow (the cluster's: rate, burst); what it leaves out falls back to the stored
default, then to admission's settings.

  turnstilectl limits show                        every stored document
  turnstilectl limits show acme                   one key's (or --default, --cluster)
  turnstilectl limits set acme '{"cap": 5}'       replace acme's whole document
  turnstilectl limits patch acme '{"rate": 2}'    merge in (null removes a field)
  turnstilectl limits delete acme                 acme falls back to the defaults
"""


def _limits(sub: Subparsers) -> None:
    limits = command(
        sub,
        "limits",
        "turnstile_cli.commands.limits:_limits",
        service="admission",
        help="show or change per-key limits (cap, rate, burst, concurrency, weight, level)",
        description=LIMITS_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = limits.add_subparsers(dest="verb", metavar="VERB", required=True)
    helps = {
        "show": ("the stored documents, or one", ("get",)),
        "set": ("replace a document (says what it replaced)", ()),
        "patch": ("merge fields into a document (null removes one)", ()),
        "delete": ("remove a document: the next level applies", ()),
    }
    for name, (text, hidden) in helps.items():
        for parser in verb(verbs, name, help=text, hidden=hidden):
            which = parser.add_mutually_exclusive_group(required=name != "show")
            which.add_argument(
                # Not dest "key": that is the common --key (the TLS private key).
                "limits_key",
                nargs="?",
                metavar="KEY",
                type=bounded_key,
                help="a bounded key: an allowlisted client id, or shared, native, unattributed",
            )
            which.add_argument("--default", action="store_true", help="every key's defaults")
            which.add_argument("--cluster", action="store_true", help="the cluster bucket")
            if name in ("set", "patch"):
                parser.add_argument("document", help="JSON, e.g. '{\"cap\": 5}'")


def _tiers(sub: Subparsers) -> None:
    tiers = command(
        sub,
        "tiers",
        "turnstile_cli.commands.tiers:_tiers",
        help="validate a tier configuration (exit 1 when invalid)",
        description="Validate declared tiers and the default tier with the services' own "
        "parser. Without options, reads TURNSTILE_TIERS and TURNSTILE_DEFAULT_TIER, or, "
        "when those are unset, the running local stack's (.run/stack.json).",
    )
    tiers.add_argument(
        "--tiers", help="comma-separated tiers (default: $TURNSTILE_TIERS or the local stack's)"
    )
    tiers.add_argument("--default-tier", help="(default: $TURNSTILE_DEFAULT_TIER)")


def _status(sub: Subparsers) -> None:
    status = command(
        sub,
        "status",
        "turnstile_cli.commands.status:_status",
        help="health of the three services (exit 4 if any is down)",
    )
    add_watch(status)


def _traces(sub: Subparsers) -> None:
    traces = command(
        sub,
        "traces",
        "turnstile_cli.commands.traces:_traces",
        help="the local stack's last traces, as trees (span, service, duration, status)",
        description="The last traces the local stack's own OTLP receiver got (./scripts/up runs "
        "one when no jaeger binary is on PATH and OTEL_EXPORTER_OTLP_ENDPOINT is unset), "
        "newest first, each span under its parent.",
    )
    traces.add_argument(
        "-n", "--limit", type=non_negative, default=5, help="how many (default 5; 0: all)"
    )
    traces.add_argument("--service", help="only traces with a span of this service")
    traces.add_argument("--trace-id", help="only this trace (the id --trace prints)")


def _stack(sub: Subparsers) -> None:
    up = command(
        sub,
        "up",
        "turnstile_cli.stack.command:_up",
        help="run the local stack (no Docker, no Kubernetes) until Ctrl-C",
        description="Apply migrations, start admission, substrate (Direct) and affinity as "
        "local processes, wait until each is SERVING, stream their logs, and stop "
        "everything on Ctrl-C, SIGTERM or SIGHUP. Redis and PostgreSQL must answer "
        "(./scripts/up starts them).",
    )
    env = os.environ.get
    up.add_argument("--redis-url", default=env("TURNSTILE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    up.add_argument(
        "--redis-prefix",
        default=env("TURNSTILE_REDIS_PREFIX"),
        help="the stack's key prefix (default: $TURNSTILE_REDIS_PREFIX, else one of this "
        "checkout's own, turnstile:<hash of its path>:, so two checkouts on one Redis "
        "never share keys)",
    )
    up.add_argument(
        "--database-url",
        default=env("TURNSTILE_DATABASE_URL"),
        help="created when missing (default: $TURNSTILE_DATABASE_URL, else a database of "
        "this checkout's own on the local server, turnstile_<hash of its path>)",
    )
    up.add_argument(
        "--grpc-ports",
        type=_triple,
        metavar="A,S,F",
        help="gRPC ports (default: 50051,50052,50053; one another process holds moves to a "
        "free port, named in the banner and in the stack file the CLI reads)",
    )
    up.add_argument(
        "--metrics-ports",
        type=_triple,
        metavar="A,S,F",
        help="Prometheus ports, 0 turns one off (default: 9091,9092,9093, moved like the "
        "gRPC ports when taken)",
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
    up.add_argument(
        "--tls-dir",
        type=Path,
        default=Path(".run/tls"),
        help="the local CA, every process's certificate and the policy, issued on first "
        "start (default: .run/tls)",
    )
    up.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS and no authorization (loopback only; for debugging)",
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
    up.add_argument(
        "--prune-after",
        type=float,
        default=24.0,
        metavar="HOURS",
        help="at start, remove the state directories of sandboxes stopped longer ago than "
        "this (default 24; 0: every stopped sandbox's)",
    )
    up.add_argument(
        "--prometheus-port",
        type=int,
        help="when Prometheus is installed, run one here scraping the stack with "
        "deploy/prometheus's rules (default 9090, or a free port when that is taken; 0: none)",
    )
    up.add_argument(
        "--reset",
        action="store_true",
        help="instead of starting: drop this checkout's own database, delete its Redis "
        "prefix's keys and its sandboxes' directories (certificates kept), after a prompt",
    )
    up.add_argument("-y", "--yes", action="store_true", help="--reset without asking")
    up.add_argument(
        "--prometheus-scrape-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="its scrape and rule-evaluation interval (default 5)",
    )


def _demo(sub: Subparsers) -> None:
    demo = command(
        sub,
        "demo",
        "turnstile_cli.demo:_demo",
        help="tell a short story against the running local stack (turnstilectl up)",
        description=DEMO_DESCRIPTION,
    )
    demo.add_argument(
        "--max-wait",
        type=float,
        default=180.0,
        help="longest wait for a worker or for the grace period to pass (default 180 s)",
    )
