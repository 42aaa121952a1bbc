"""Parsing ``turnstile.common.v1`` client messages into :class:`Client`, with the
validation every service applies the same way."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from turnstile_clientkeys.ids import client_id_problem
from turnstile_clientkeys.resolver import (
    NATIVE,
    RESERVED_IDS,
    SHARED,
    UNATTRIBUTED,
    Client,
    ClientForm,
    KeyKind,
)
from turnstile_contracts import admission_pb2, common_pb2


@dataclass(eq=False)
class InvalidClientError(ValueError):
    """A client message that cannot be accepted: ``field`` names the path."""

    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


def parse_client(
    message: common_pb2.ActivationClient,
    *,
    allowed: Collection[ClientForm],
    field: str = "client",
) -> Client:
    """The :class:`Client` a message names, or :class:`InvalidClientError`.

    ``allowed`` is what the calling RPC accepts (Activate takes inherit, Admit
    does not). A client id must pass :func:`client_id_problem` and not be a reserved id;
    one that is not a label value is accepted and charged to the shared key.
    """
    form_name = message.WhichOneof("client")
    if form_name is None:
        raise InvalidClientError(field, "must be set: one of client_id, inherit, native")
    form = ClientForm(form_name)
    if form not in allowed:
        names = ", ".join(sorted(f.value for f in allowed))
        raise InvalidClientError(f"{field}.{form.value}", f"not accepted here; use one of: {names}")
    if form is not ClientForm.CLIENT_ID:
        return Client(form)
    return Client.of(parse_client_id(message.client_id, field=f"{field}.client_id"))


def parse_client_id(client_id: str, *, field: str) -> str:
    """``client_id`` if a caller may send it as a client id (the rule of
    :func:`parse_client`'s ``client_id`` form), else :class:`InvalidClientError`
    naming ``field``: for fields that carry a bare id (the key set's allowlist)."""
    problem = client_id_problem(client_id)
    if problem is not None:
        raise InvalidClientError(field, problem)
    if client_id in RESERVED_IDS:
        raise InvalidClientError(field, f"{client_id!r} is reserved; use the matching client form")
    return client_id


def to_proto(client: Client) -> common_pb2.ActivationClient:
    """The contract message for ``client``."""
    if client.form is ClientForm.CLIENT_ID:
        return common_pb2.ActivationClient(client_id=client.client_id or "")
    if client.form is ClientForm.INHERIT:
        return common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())
    if client.form is ClientForm.NATIVE:
        return common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())
    return common_pb2.ActivationClient(unattributed=common_pb2.ActivationClient.Unattributed())


KEY_KINDS: dict[KeyKind, common_pb2.KeyKind.ValueType] = {
    KeyKind.OWN: common_pb2.KEY_KIND_OWN,
    KeyKind.SHARED: common_pb2.KEY_KIND_SHARED,
    KeyKind.NATIVE: common_pb2.KEY_KIND_NATIVE,
    KeyKind.UNATTRIBUTED: common_pb2.KEY_KIND_UNATTRIBUTED,
}


def limits_target(key: str) -> admission_pb2.LimitsTarget:
    """The admin API's ``LimitsTarget`` for one bounded key's document: ``shared``,
    ``native``, ``unattributed`` or a client id (SPEC M1). One builder for the
    service that answers with it and the CLI that asks with it."""
    if key == SHARED:
        return admission_pb2.LimitsTarget(shared=admission_pb2.LimitsTarget.Shared())
    if key == NATIVE:
        client = common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())
    elif key == UNATTRIBUTED:
        client = common_pb2.ActivationClient(
            unattributed=common_pb2.ActivationClient.Unattributed()
        )
    else:
        client = common_pb2.ActivationClient(client_id=key)
    return admission_pb2.LimitsTarget(client=client)
