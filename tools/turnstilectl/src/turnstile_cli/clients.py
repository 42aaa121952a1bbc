"""The ``--client`` / ``--inherit`` / ``--native`` / ``--unattributed`` options.

The CLI sends what the user typed; the service validates it (one place, the
shared resolver's contract) and an invalid id comes back as INVALID_ARGUMENT
naming the field.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser imports this module; protobuf only when a command runs
    from turnstile_contracts import common_pb2

FORMS = ("client", "inherit", "native", "unattributed")


def add_client_options(
    parser: argparse.ArgumentParser, *, forms: Collection[str], required: bool = True
) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    if "client" in forms:
        group.add_argument("--client", metavar="ID", help="charge this client id")
    if "inherit" in forms:
        group.add_argument(
            "--inherit",
            action="store_true",
            help="act for the sandbox's recorded client (as an implicit wake does)",
        )
    if "native" in forms:
        group.add_argument("--native", action="store_true", help="the platform itself")
    if "unattributed" in forms:
        group.add_argument(
            "--unattributed",
            action="store_true",
            help="the reserved key of inheriting activations with no recorded client",
        )


def client_from_args(args: argparse.Namespace) -> common_pb2.ActivationClient:
    from turnstile_contracts import common_pb2

    if getattr(args, "inherit", False):
        return common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())
    if getattr(args, "native", False):
        return common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())
    if getattr(args, "unattributed", False):
        return common_pb2.ActivationClient(unattributed=common_pb2.ActivationClient.Unattributed())
    return common_pb2.ActivationClient(client_id=args.client or "")


def describe(client: common_pb2.ActivationClient) -> str:
    form = client.WhichOneof("client")
    return client.client_id if form == "client_id" else f"({form})"
