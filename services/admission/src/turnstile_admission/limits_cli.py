"""``turnstile-admission-limits``: show and change per-key limits in Redis.

``turnstilectl limits`` does the same with validation against the key set
(and a warning when a key is not allowlisted, so its limits are not in effect);
this command stays for scripts that run beside an admission replica, with only
its settings. The change applies to the next decision on every replica
(``admit.lua`` reads the limits itself). Examples::

    turnstile-admission-limits show
    turnstile-admission-limits set acme '{"cap": 50, "rate": 5, "burst": 50}'
    turnstile-admission-limits set-default '{"concurrency": 20}'
    turnstile-admission-limits set-cluster '{"rate": 100, "burst": 400}'
    turnstile-admission-limits clear acme
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys.limits import ClusterLimits, Limits, LimitsError, LimitsStore
from turnstile_platform.redis_client import redis_from_settings


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


async def _run(args: argparse.Namespace) -> None:
    settings = AdmissionSettings()
    client = redis_from_settings(settings)
    store = LimitsStore(client, settings.redis_prefix)
    try:
        if args.command == "show":
            print(json.dumps(await store.show(), indent=2, sort_keys=True))
        elif args.command == "set":
            await store.set_key(args.key, Limits.parse(json.loads(args.limits)))
        elif args.command == "set-default":
            await store.set_default(Limits.parse(json.loads(args.limits)))
        elif args.command == "set-cluster":
            await store.set_cluster(ClusterLimits.parse(json.loads(args.limits)))
        elif args.command == "clear":
            await store.clear_key(args.key)
    finally:
        await client.aclose()


def main() -> None:
    args = _parser().parse_args()
    try:
        asyncio.run(_run(args))
    except (LimitsError, json.JSONDecodeError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
