"""``turnstile-admission-limits``: BREAK-GLASS access to the limits hash in Redis.

The way to change limits is ``turnstilectl limits`` (admission's AdminService:
authorized, validated, audited; SPEC M1). This command is for when admission
itself cannot answer (it writes Redis directly with a replica's settings, so it
needs Redis credentials, not an operator's certificate). It says so on every
change, validates each document with the same parser, makes the change in the
same bounded transaction, and records it in the decision log like the API does,
as ``break-glass:<OS user>``. Examples::

    turnstile-admission-limits show
    turnstile-admission-limits set acme '{"cap": 50, "rate": 5, "burst": 50}'
    turnstile-admission-limits set-default '{"concurrency": 20}'
    turnstile-admission-limits set-cluster '{"rate": 100, "burst": 400}'
    turnstile-admission-limits clear acme
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import sys
from typing import Any

from turnstile_admission.admin import KEY_PREFIX, validated
from turnstile_admission.audit import LIMITS_CHANGED, AuditLog
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys.limits import (
    CLUSTER,
    DEFAULT,
    LimitsConflictError,
    LimitsError,
    LimitsStore,
)
from turnstile_platform.redis_client import redis_from_settings

WARNING = (
    "BREAK-GLASS: writing admission's limits in Redis directly, bypassing the admin API's "
    "authorization; use `turnstilectl limits` whenever admission answers"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turnstile-admission-limits",
        description=__doc__,
        # The docstring's examples are laid out by hand: keep its line breaks.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("show", help="print every stored limit as JSON")
    one = sub.add_parser("set", help="set one bounded key's limits")
    one.add_argument("key")
    one.add_argument("limits", help='JSON, e.g. {"cap": 50}')
    default = sub.add_parser("set-default", help="set the defaults of every key")
    default.add_argument("limits")
    cluster = sub.add_parser("set-cluster", help="set the cluster bucket")
    cluster.add_argument("limits", help='JSON, e.g. {"rate": 100, "burst": 400}')
    clear = sub.add_parser("clear", help="drop one key's limits (it gets the defaults)")
    clear.add_argument("key")
    return parser


def _field(args: argparse.Namespace) -> str:
    if args.command == "set-default":
        return DEFAULT
    if args.command == "set-cluster":
        return CLUSTER
    return LimitsStore.field_of(args.key)


async def _run(args: argparse.Namespace) -> None:
    settings = AdmissionSettings()
    client = redis_from_settings(settings)
    store = LimitsStore(client, settings.redis_prefix)
    try:
        if args.command == "show":
            print(json.dumps(await store.show(), indent=2, sort_keys=True))
            return
        field = _field(args)
        document: Any = None
        if args.command != "clear":
            document = validated(field, json.loads(args.limits))
        print(f"warning: {WARNING}", file=sys.stderr)
        previous, current = await store.change(field, lambda _: document)
        if previous != current:
            await AuditLog(client, settings.redis_prefix, settings.decision_log).append(
                LIMITS_CHANGED,
                identity=f"break-glass:{getpass.getuser()}",
                target=field,
                verb="delete" if document is None else "set",
                previous=previous,
                current=current,
                key=field.removeprefix(KEY_PREFIX) if field.startswith(KEY_PREFIX) else "",
            )
    finally:
        await client.aclose()


def main() -> None:
    args = _parser().parse_args()
    try:
        asyncio.run(_run(args))
    except (LimitsError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except LimitsConflictError as error:
        print(f"error: {error}; nothing changed: retry", file=sys.stderr)
        sys.exit(4)


if __name__ == "__main__":
    main()
