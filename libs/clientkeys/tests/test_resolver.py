"""The resolver's bounded keys (SPEC C2–C4)."""

from __future__ import annotations

import pytest

from turnstile_clientkeys import (
    NATIVE,
    SHARED,
    UNATTRIBUTED,
    Client,
    ClientForm,
    InvalidClientError,
    KeyKind,
    KeySet,
    Resolver,
    parse_client,
    record_value,
    to_proto,
)
from turnstile_clientkeys import resolver as resolver_module
from turnstile_contracts import common_pb2

ALL_FORMS = set(ClientForm)


def resolver(*allow: str, own_keys: bool = True, version: int = 7) -> Resolver:
    return Resolver(
        KeySet(version=version, allowlist=frozenset(allow), flags={"own_keys": own_keys})
    )


def test_allowlisted_label_valid_id_gets_its_own_key_with_the_version() -> None:
    key = resolver("acme").resolve(Client.of("acme"))
    assert (key.key, key.kind, key.version) == ("acme", KeyKind.OWN, 7)


def test_everyone_else_shares_one_key() -> None:
    r = resolver("acme")
    assert {r.resolve(Client.of(c)).key for c in ("globex", "initech", "x" * 200)} == {SHARED}


def test_allowlisted_id_that_is_not_a_label_value_gets_the_shared_key_and_is_never_stored() -> None:
    bad = "acme corp!"
    r = resolver(bad)
    assert r.resolve(Client.of(bad)).kind is KeyKind.SHARED
    assert record_value(Client.of(bad)) == SHARED
    assert record_value(Client.of("x" * 64)) == SHARED


def test_reserved_keys() -> None:
    r = resolver()
    assert r.resolve(Client.native()).key == NATIVE
    assert r.resolve(Client.unattributed()).key == UNATTRIBUTED
    with pytest.raises(ValueError, match="inherit"):
        r.resolve(Client.inherit())


def test_inherit_with_a_recorded_client_charges_it_and_null_charges_the_reserved_key() -> None:
    r = resolver("acme")
    assert r.resolve(Client.from_record("acme")).key == "acme"
    assert r.resolve(Client.from_record(None)).kind is KeyKind.UNATTRIBUTED
    assert record_value(Client.from_record(None)) is None
    assert r.resolve(Client.from_record(NATIVE)).kind is KeyKind.NATIVE


def test_own_keys_flag_off_sends_every_client_to_the_shared_key() -> None:
    assert resolver("acme", own_keys=False).resolve(Client.of("acme")).key == SHARED


def test_a_swapped_key_set_applies_to_the_next_resolution() -> None:
    r = resolver()
    assert r.resolve(Client.of("acme")).key == SHARED
    r.swap(r.keyset.changed(allow=["acme"]))
    key = r.resolve(Client.of("acme"))
    assert (key.key, key.version) == ("acme", 8)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (common_pb2.ActivationClient(), "client"),
        (common_pb2.ActivationClient(client_id=""), "client.client_id"),
        (common_pb2.ActivationClient(client_id="x" * 254), "client.client_id"),
        (common_pb2.ActivationClient(client_id="native"), "client.client_id"),
        (common_pb2.ActivationClient(client_id="shared"), "client.client_id"),
        (common_pb2.ActivationClient(client_id="a\tb"), "client.client_id"),
    ],
)
def test_bad_client_messages_name_the_field(
    message: common_pb2.ActivationClient, field: str
) -> None:
    with pytest.raises(InvalidClientError) as caught:
        parse_client(message, allowed=ALL_FORMS)
    assert caught.value.field == field


def test_a_form_the_rpc_does_not_accept_is_refused() -> None:
    inherit = to_proto(Client.inherit())
    with pytest.raises(InvalidClientError) as caught:
        parse_client(inherit, allowed={ClientForm.CLIENT_ID, ClientForm.NATIVE})
    assert caught.value.field == "client.inherit"


def test_proto_round_trip() -> None:
    for client in (Client.of("acme"), Client.inherit(), Client.native(), Client.unattributed()):
        assert parse_client(to_proto(client), allowed=ALL_FORMS) == client


def test_the_memo_stops_growing_and_every_client_still_resolves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``MAX_REMEMBERED`` clients are resolved every time, and a swap
    reaches remembered and unremembered ones alike."""
    monkeypatch.setattr(resolver_module, "MAX_REMEMBERED", 1)
    r = resolver("acme", "globex")
    assert [r.resolve(Client.of(c)).key for c in ("acme", "globex", "acme", "globex")] == [
        "acme",
        "globex",
        "acme",
        "globex",
    ]
    r.swap(r.keyset.changed(remove=["acme", "globex"]))
    assert {r.resolve(Client.of(c)).key for c in ("acme", "globex")} == {SHARED}
