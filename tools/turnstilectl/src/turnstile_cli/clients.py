"""The ``--client`` / ``--inherit`` / ``--native`` / ``--unattributed`` options,
and the one parser of every client id the command line takes.

:func:`client_id` is the ``type`` of every argument that names a client (``--client``
of every command, ``keys allow``, ``limits`` keys): the services' own parser
(:func:`turnstile_clientkeys.contract.parse_client`), and a label value, since an
id that is not one can never have its own key nor be recorded (SPEC C3, A2): it
is a typo, told at once with the rule (exit 2), not charged to the shared key.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser imports this module; protobuf only when a command runs
    from turnstile_contracts import common_pb2

FORMS = ("client", "inherit", "native", "unattributed")

#: The rule :func:`client_id` applies, in the words its refusals use.
CLIENT_ID_RULE = (
    "a client id is 1 to 63 letters, digits, '-', '_' or '.', beginning and ending "
    "with a letter or digit (a Kubernetes label value), and not a reserved id "
    "(native, shared, unattributed)"
)


def client_id(text: str) -> str:
    """``text`` as a client id, or :class:`argparse.ArgumentTypeError` saying why
    and the rule. Imported by argparse's call, so only a command given an id pays
    for the contracts' import."""
    from turnstile_clientkeys import is_label_value
    from turnstile_clientkeys.contract import InvalidClientError, parse_client
    from turnstile_clientkeys.resolver import ClientForm
    from turnstile_contracts import common_pb2

    try:
        parse_client(
            common_pb2.ActivationClient(client_id=text),
            allowed={ClientForm.CLIENT_ID},
            field="client",
        )
    except InvalidClientError as error:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a client id ({error.description}); {CLIENT_ID_RULE}"
        ) from None
    if not is_label_value(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a client id (not a label value); {CLIENT_ID_RULE}"
        )
    return text


def client_filter(text: str) -> str:
    """A ``--client`` filter (``sandboxes``, ``workers``): empty for none, else a
    client id (:func:`client_id`)."""
    return text if text == "" else client_id(text)


def bounded_key(text: str) -> str:
    """A bounded key of ``limits``: a client id (:func:`client_id`) or a reserved
    key (``shared``, ``native``, ``unattributed``), which have limits too."""
    from turnstile_clientkeys import RESERVED_IDS

    return text if text in RESERVED_IDS else client_id(text)


def add_client_options(
    parser: argparse.ArgumentParser, *, forms: Collection[str], required: bool = True
) -> None:
    group = parser.add_mutually_exclusive_group(required=required)
    if "client" in forms:
        group.add_argument("--client", metavar="ID", type=client_id, help="charge this client id")
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
