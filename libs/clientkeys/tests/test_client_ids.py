"""One client-id rule (1 to 63 printable characters, no surrounding whitespace) for
every request field and the key set's allowlist."""

from __future__ import annotations

import pytest

from turnstile_clientkeys import (
    MAX_CLIENT_ID_LENGTH,
    InvalidClientError,
    KeySet,
    KeySetError,
    client_id_problem,
    parse_client,
)
from turnstile_clientkeys.resolver import ClientForm
from turnstile_contracts import common_pb2

ALL_FORMS = tuple(ClientForm)


def _client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


def test_the_limit_is_the_protos_63_characters() -> None:
    assert MAX_CLIENT_ID_LENGTH == 63
    assert parse_client(_client("a" * 63), allowed=ALL_FORMS).client_id == "a" * 63


@pytest.mark.parametrize(
    ("client_id", "why"),
    [
        ("a" * 64, "at most 63"),
        ("", "empty"),
        ("   ", "whitespace"),
        (" acme", "whitespace"),
        ("ac\x00me", "printable"),
        ("ac\nme", "printable"),
    ],
)
def test_a_bad_client_id_is_refused_naming_the_field(client_id: str, why: str) -> None:
    with pytest.raises(InvalidClientError) as raised:
        parse_client(_client(client_id), allowed=ALL_FORMS)
    assert raised.value.field == "client.client_id"
    assert why in raised.value.description
    assert client_id_problem(client_id) is not None


def test_a_printable_id_that_is_not_a_label_value_is_still_a_client() -> None:
    assert client_id_problem("acme corp/eu") is None


@pytest.mark.parametrize("client_id", ["a" * 64, "", "  ", "x\x00"])
def test_the_allowlist_refuses_what_requests_refuse(client_id: str) -> None:
    with pytest.raises(KeySetError):
        KeySet().changed(allow=[client_id])
