"""The client-key resolver every Turnstile service uses (SPEC C1–C4)."""

from turnstile_clientkeys.contract import InvalidClientError, parse_client, to_proto
from turnstile_clientkeys.ids import MAX_CLIENT_ID_LENGTH, client_id_problem
from turnstile_clientkeys.keyset import KeySet, KeySetError
from turnstile_clientkeys.labels import MAX_LABEL_VALUE_LENGTH, is_label_value
from turnstile_clientkeys.live_counts import LiveCountKeys
from turnstile_clientkeys.resolver import (
    NATIVE,
    RESERVED_IDS,
    SHARED,
    UNATTRIBUTED,
    BoundedKey,
    Client,
    ClientForm,
    KeyKind,
    Resolver,
    record_value,
)
from turnstile_clientkeys.store import KeySetStore, KeySetWatcher, watch_keyset

__all__ = [
    "MAX_CLIENT_ID_LENGTH",
    "MAX_LABEL_VALUE_LENGTH",
    "NATIVE",
    "RESERVED_IDS",
    "SHARED",
    "UNATTRIBUTED",
    "BoundedKey",
    "Client",
    "ClientForm",
    "InvalidClientError",
    "KeyKind",
    "KeySet",
    "KeySetError",
    "KeySetStore",
    "KeySetWatcher",
    "LiveCountKeys",
    "Resolver",
    "client_id_problem",
    "is_label_value",
    "parse_client",
    "record_value",
    "to_proto",
    "watch_keyset",
]
