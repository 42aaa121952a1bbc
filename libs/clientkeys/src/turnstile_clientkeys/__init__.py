"""The client-key resolver every Turnstile service uses (SPEC C1–C4).

The protobuf mapping (:mod:`.contract`) and the Redis-backed key-set store
(:mod:`.store`) are imported on first use (PEP 562): the worker agent, which
only validates label values, starts without loading redis-py and the
admission contracts (a third of its start-up, which a woken sandbox waits for).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from turnstile_clientkeys.contract import InvalidClientError, parse_client, to_proto
    from turnstile_clientkeys.store import KeySetStore, KeySetWatcher, watch_keyset

#: Names imported on first use, and the submodule each comes from.
_LAZY = {
    "InvalidClientError": "contract",
    "parse_client": "contract",
    "to_proto": "contract",
    "KeySetStore": "store",
    "KeySetWatcher": "store",
    "watch_keyset": "store",
}

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


def __getattr__(name: str) -> object:
    submodule = _LAZY.get(name)
    if submodule is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{submodule}"), name)
    globals()[name] = value
    return value
