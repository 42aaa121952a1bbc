"""Which uid a Direct runtime runs as (SPEC O4): never the substrate's own when it can help it.

A runtime runs untrusted code. As the substrate's uid it could read every file the
substrate can (the signing, TLS and CA keys, the database password) and its
``/proc/<pid>/environ``; another uid can read none of them. Three modes:

- **a uid per runtime** (``TURNSTILE_DIRECT_RUNTIME_UIDS=first-last``): a uid of the
  range no other running runtime holds, cleared of any process before it is handed
  out, so runtimes cannot read each other's files either (the strongest mode; the
  uids share group ``first``, which reads only the sandbox-class TLS files);
- **one shared user** (``TURNSTILE_DIRECT_RUNTIME_USER``): kept from the substrate's
  secrets, not from each other;
- **the substrate's own uid**: when neither is set and the substrate is not root;
  only the environment is isolated.

A root substrate with neither refuses to start: untrusted code never runs as root by
default. docs/security.md ("Runtimes hold no secrets") has the layout and limits.
"""

from __future__ import annotations

import os
import pwd
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

from turnstile_platform.settings import SettingsError

_RANGE = re.compile(r"(\d+)-(\d+)")

#: The largest uid Linux hands out ((uid_t)-1 means "unchanged").
_MAX_UID = 2**32 - 2


@dataclass(frozen=True)
class Identity:
    """The uid and primary gid one runtime runs as."""

    uid: int
    gid: int


def parse_range(value: str) -> range:
    """``first-last`` (inclusive) as a range; ValueError naming the setting otherwise."""
    match = _RANGE.fullmatch(value.strip())
    if match is None:
        raise SettingsError(
            "TURNSTILE_DIRECT_RUNTIME_UIDS must be 'first-last', e.g. 200000-200999"
        )
    first, last = int(match[1]), int(match[2])
    if not 0 < first <= last <= _MAX_UID:
        raise SettingsError(
            "TURNSTILE_DIRECT_RUNTIME_UIDS must be 'first-last' with 0 < first <= last "
            f"<= {_MAX_UID} (never root)"
        )
    return range(first, last + 1)


def parse_user(value: str) -> Identity:
    """A user name (its uid and primary group) or a number (its passwd entry's group
    if it has one, else the same number as gid)."""
    value = value.strip()
    if value.isdigit():
        uid = int(value)
        if uid > _MAX_UID:
            raise SettingsError(f"TURNSTILE_DIRECT_RUNTIME_USER: uid {uid} is out of range")
        try:
            return Identity(uid, pwd.getpwuid(uid).pw_gid)
        except KeyError:
            return Identity(uid, uid)
    try:
        entry = pwd.getpwnam(value)
    except KeyError:
        raise SettingsError(
            f"TURNSTILE_DIRECT_RUNTIME_USER: no user {value!r} on this host"
        ) from None
    return Identity(entry.pw_uid, entry.pw_gid)


class RuntimeUsers:
    """Hands out the identity each runtime starts as (thread-safe: starts run in threads)."""

    def __init__(
        self,
        *,
        shared: Identity | None = None,
        uids: range | None = None,
        clear: Callable[[int, int], None] | None = None,
    ) -> None:
        """``shared``: every runtime's identity; ``uids``: a uid per runtime (gid: the
        range's first number); neither: the substrate's own. ``clear(uid, gid)`` kills
        every process of a uid of the range before it is handed out (nothing of an
        earlier runtime may outlive it into the next one's)."""
        assert shared is None or uids is None
        self.shared = shared
        self.uids = uids
        self._clear = clear
        self._lock = threading.Lock()
        #: Uids being started with, and uids of running runtimes (by sandbox id).
        self._reserved: set[int] = set()
        self._bound: dict[str, int] = {}

    @classmethod
    def from_settings(cls, user: str, uids: str, clear: Callable[[int, int], None]) -> RuntimeUsers:
        """The mode the two settings name, checked against who this process is."""
        if user.strip() and uids.strip():
            raise SettingsError(
                "set one of TURNSTILE_DIRECT_RUNTIME_USER and TURNSTILE_DIRECT_RUNTIME_UIDS"
            )
        own = os.geteuid()
        if uids.strip():
            if own != 0:
                raise SettingsError(
                    "TURNSTILE_DIRECT_RUNTIME_UIDS needs the substrate to run as root"
                )
            return cls(uids=parse_range(uids), clear=clear)
        if user.strip():
            identity = parse_user(user)
            if identity.uid == own:
                return cls()
            if own != 0:
                raise SettingsError(
                    "TURNSTILE_DIRECT_RUNTIME_USER needs the substrate to run as root"
                )
            return cls(shared=identity)
        if own == 0:
            raise SettingsError(
                "the Direct substrate runs as root: set TURNSTILE_DIRECT_RUNTIME_UIDS (a uid "
                "per runtime) or TURNSTILE_DIRECT_RUNTIME_USER, so runtimes do not run as root "
                "(TURNSTILE_DIRECT_RUNTIME_USER=root only if you mean it)"
            )
        return cls()

    @property
    def switching(self) -> bool:
        """Whether runtimes run as another uid than the substrate."""
        return self.shared is not None or self.uids is not None

    @property
    def group(self) -> int | None:
        """The group every runtime is in (it may read the sandbox-class TLS files)."""
        if self.uids is not None:
            return self.uids.start
        return self.shared.gid if self.shared is not None else None

    def adopt(self, sandbox_id: str, uid: int | None) -> None:
        """A runtime found running (after a restart) holds its uid."""
        if self.exclusive(uid):
            assert uid is not None
            with self._lock:
                self._bound[sandbox_id] = uid

    def acquire(self, preferred: int | None = None) -> Identity | None:
        """The identity of a runtime about to start (None: the substrate's own).

        Per-runtime uids: ``preferred`` (the owner of a restored workspace) when it
        is in the range and free, else the first free one — free meaning neither
        reserved by a start in progress nor bound to a running runtime. Reserved
        until :meth:`bind` or :meth:`release`, so concurrent starts never share one,
        and cleared of any process before it is returned. RuntimeError when every
        uid of the range is held.
        """
        if self.uids is None:
            return self.shared
        with self._lock:
            held = self._reserved | set(self._bound.values())
            if preferred is not None and preferred in self.uids and preferred not in held:
                uid = preferred
            else:
                uid = next((uid for uid in self.uids if uid not in held), -1)
                if uid < 0:
                    raise RuntimeError(
                        "every uid of TURNSTILE_DIRECT_RUNTIME_UIDS is held by a running runtime"
                    )
            self._reserved.add(uid)
        identity = Identity(uid, self.uids.start)
        if self._clear is not None:
            try:
                self._clear(identity.uid, identity.gid)
            except BaseException:
                self.release(identity)
                raise
        return identity

    def bind(self, sandbox_id: str, identity: Identity | None) -> None:
        """The runtime started: its uid is held until :meth:`unbind`."""
        if identity is not None and self.uids is not None:
            with self._lock:
                self._reserved.discard(identity.uid)
                self._bound[sandbox_id] = identity.uid

    def release(self, identity: Identity | None) -> None:
        """End a reservation whose runtime did not start."""
        if identity is not None and self.uids is not None:
            with self._lock:
                self._reserved.discard(identity.uid)

    def unbind(self, sandbox_id: str) -> None:
        """The sandbox's runtime has ended (and its uid's processes were killed)."""
        with self._lock:
            self._bound.pop(sandbox_id, None)

    def exclusive(self, uid: int | None) -> bool:
        """Whether ``uid`` belongs to one runtime alone (so all its processes are that
        runtime's and may be killed with it)."""
        return uid is not None and self.uids is not None and uid in self.uids
