"""The one client-key resolver (SPEC C2, C3, C4).

Ids are stored, keys are resolved at use. Records and pod labels keep the client
id the caller sent; every policy, metric and decision turns it into a *bounded
key* here, against the current key-set snapshot, so an allowlist or flag change
takes effect everywhere at once. Resolution does no I/O: the snapshot is swapped
in by :class:`turnstile_clientkeys.store.KeySetWatcher`.

Bounded keys:

* an allowlisted id that is a valid label value → its own key (the id itself);
* ``native`` → the platform's reserved key;
* an inheriting activation whose sandbox has no recorded client → ``unattributed``;
* everyone else, including allowlisted ids that are not valid label values → ``shared``.

Every key is itself a valid label value, so keys are safe as metric labels and
Redis key parts, and their number is bounded by the key set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from turnstile_clientkeys.keyset import KeySet
from turnstile_clientkeys.labels import is_label_value

NATIVE = "native"
UNATTRIBUTED = "unattributed"
SHARED = "shared"

#: Ids no caller may send as a client id: each names a reserved key.
RESERVED_IDS = frozenset({NATIVE, UNATTRIBUTED, SHARED})


class KeyKind(enum.Enum):
    OWN = "own"
    SHARED = "shared"
    NATIVE = "native"
    UNATTRIBUTED = "unattributed"


class ClientForm(enum.Enum):
    """The forms of ``turnstile.common.v1.ActivationClient``."""

    CLIENT_ID = "client_id"
    INHERIT = "inherit"
    NATIVE = "native"
    UNATTRIBUTED = "unattributed"


@dataclass(frozen=True)
class Client:
    """Who an activation is charged to, as parsed from the contract."""

    form: ClientForm
    client_id: str | None = None

    @classmethod
    def of(cls, client_id: str) -> Client:
        return cls(ClientForm.CLIENT_ID, client_id)

    @classmethod
    def native(cls) -> Client:
        return cls(ClientForm.NATIVE)

    @classmethod
    def inherit(cls) -> Client:
        return cls(ClientForm.INHERIT)

    @classmethod
    def unattributed(cls) -> Client:
        return cls(ClientForm.UNATTRIBUTED)

    @classmethod
    def from_record(cls, recorded: str | None) -> Client:
        """What ``inherit`` means for a sandbox whose record holds ``recorded`` (C4)."""
        if recorded is None:
            return cls.unattributed()
        if recorded == NATIVE:
            return cls.native()
        return cls.of(recorded)


@dataclass(frozen=True)
class BoundedKey:
    key: str
    kind: KeyKind
    version: int


#: How many clients' bounded keys a resolver remembers per key-set snapshot.
MAX_REMEMBERED = 4096


class Resolver:
    """Resolves clients to bounded keys against the current key-set snapshot.

    A client's key is a function of the client and the snapshot alone, and every
    Admit resolves one, so each is remembered until the next :meth:`swap`.
    Callers choose client ids, so the memo stops growing at ``MAX_REMEMBERED``;
    later clients are resolved every time."""

    def __init__(self, keyset: KeySet | None = None) -> None:
        self._keyset = keyset or KeySet()
        self._resolved: dict[Client, BoundedKey] = {}

    @property
    def keyset(self) -> KeySet:
        return self._keyset

    @property
    def version(self) -> int:
        return self._keyset.version

    def swap(self, keyset: KeySet) -> None:
        """Install a new snapshot; later resolutions use it."""
        self._resolved = {}
        self._keyset = keyset

    def resolve_id(self, client_id: str) -> BoundedKey:
        """The bounded key of a client id (never a reserved id)."""
        keyset = self._keyset
        if (
            keyset.flag("own_keys")
            and client_id in keyset.allowlist
            and is_label_value(client_id)
            and client_id not in RESERVED_IDS
        ):
            return BoundedKey(client_id, KeyKind.OWN, keyset.version)
        return BoundedKey(SHARED, KeyKind.SHARED, keyset.version)

    def resolve(self, client: Client) -> BoundedKey:
        """The bounded key of a charged client. ``inherit`` must be resolved first."""
        key = self._resolved.get(client)
        if key is None:
            key = self._resolve(client)
            if len(self._resolved) < MAX_REMEMBERED:
                self._resolved[client] = key
        return key

    def _resolve(self, client: Client) -> BoundedKey:
        version = self._keyset.version
        if client.form is ClientForm.NATIVE:
            return BoundedKey(NATIVE, KeyKind.NATIVE, version)
        if client.form is ClientForm.UNATTRIBUTED:
            return BoundedKey(UNATTRIBUTED, KeyKind.UNATTRIBUTED, version)
        if client.form is ClientForm.INHERIT or client.client_id is None:
            raise ValueError("inherit must be resolved from the sandbox record before charging")
        return self.resolve_id(client.client_id)

    def resolve_label(self, label_value: str | None) -> BoundedKey:
        """The bounded key a pod's client-id label (or a record) is charged to now."""
        return self.resolve(Client.from_record(label_value))


def record_value(client: Client) -> str | None:
    """What records and pod labels store for ``client`` (SPEC A1, A2, C3).

    The id as sent when it is a valid label value; ``native`` for the platform;
    ``None`` (NULL, no label) for unattributed; ``shared`` for an id that is not
    a valid label value, which is never written as-is.
    """
    if client.form is ClientForm.NATIVE:
        return NATIVE
    if client.form is ClientForm.UNATTRIBUTED:
        return None
    if client.form is ClientForm.INHERIT or client.client_id is None:
        raise ValueError("inherit must be resolved from the sandbox record first")
    return client.client_id if is_label_value(client.client_id) else SHARED
