"""Sandbox credentials: proof that a worker is the runtime of one sandbox (SPEC Z3).

The substrate *mints* a credential for each runtime it starts; the affinity relay
*verifies* it on a worker's ``Hello`` and on each renewal. Both services use this
module (services never import each other). A credential is ``<payload>.<signature>``:
a JSON payload (sandbox, pod uid, the runtime's random *generation*, issue and
expiry times, key id) signed with Ed25519 over a fixed context string, so a
signature made for anything else never verifies. It also carries what the
substrate started (owner, tier, capacity, endpoint: :class:`PresenceClaims`,
SPEC O3), so the relay never believes the worker's ``Hello`` about them; one
minted before them verifies with :attr:`SandboxClaims.presence` None (ownerless).

Why asymmetric: only the substrate holds the signing key, so a compromised relay
cannot mint; relays accept a key *set*, so the key rotates without a gap. Why a
Redis record as well (``<prefix>{affinity}:credential:<sandbox>``, the generation or
``revoked``): a signature cannot be taken back; ``attach.lua`` and
``heartbeat.lua`` refuse another generation atomically with presence, and a
missing record refuses nothing, so a Redis restart detaches no worker.
The format, the checks and the residual risks are in docs/security.md
("Worker credentials").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from turnstile_platform.redis_client import read_script

#: Signed before every payload: a signature over anything else never verifies.
_CONTEXT = b"turnstile.dev/sandbox-credential/v1\x00"

#: Longest credential accepted on the wire (a real one is about 300 characters).
MAX_CREDENTIAL_CHARS = 2048

#: Clock difference tolerated between the minting substrate and a verifying relay.
CLOCK_SKEW_MS = 30_000

#: The credential record's value once the sandbox's runtime ended.
REVOKED = "revoked"

#: How often a verifier looks at its public-key file for changes, at most.
_RELOAD_INTERVAL_S = 1.0


class CredentialRefusedError(Exception):
    """A credential does not prove what it is presented for.

    ``reason`` is one of ``missing``, ``malformed``, ``unknown_key``,
    ``bad_signature``, ``wrong_sandbox``, ``expired``, ``not_yet_valid`` and
    (from the relay's scripts) ``revoked``: bounded, so it can label a metric.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class PresenceClaims:
    """What the substrate started, as the credential attests it (SPEC O3)."""

    #: The sandbox's recorded client id, ``native``, or "" (no owner: unattributed).
    owner: str
    #: The tier the runtime was started in ("" with no tiers configured).
    tier: str
    #: The concurrent turns the runtime was started to serve.
    capacity: int
    #: Where the runtime serves ("" when the substrate assigned no address).
    endpoint: str


@dataclass(frozen=True)
class SandboxClaims:
    """What a verified credential says."""

    sandbox_id: str
    #: The pod's uid on Kubernetes; empty on Direct.
    pod_uid: str
    #: Random per runtime start; must equal the sandbox's credential record.
    generation: str
    issued_ms: int
    expires_ms: int
    key_id: str
    #: The attested presence; None for a credential minted before it was carried.
    presence: PresenceClaims | None = None


def _b64encode(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short stable id of a public key: the first 8 bytes of its SHA-256, in hex."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def new_generation() -> str:
    """A fresh generation for a runtime start: 128 random bits, hex."""
    return secrets.token_hex(16)


# -- keys ----------------------------------------------------------------------


class SigningKey:
    """The substrate's Ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.key_id = key_id(private_key.public_key())

    @classmethod
    def from_file(cls, path: Path) -> SigningKey:
        """A PEM (PKCS#8, unencrypted) Ed25519 private key."""
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} does not hold an Ed25519 private key")
        return cls(key)

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._key.public_key()

    def mint(
        self,
        sandbox_id: str,
        *,
        generation: str,
        ttl_ms: int,
        pod_uid: str = "",
        issued_ms: int | None = None,
        presence: PresenceClaims | None = None,
    ) -> str:
        """A credential for ``sandbox_id``'s runtime of ``generation``, valid ``ttl_ms``,
        attesting ``presence`` (None: a credential without presence claims, as minted
        before SPEC O3; tests use it to stand for an old credential)."""
        issued = now_ms() if issued_ms is None else issued_ms
        fields: dict[str, object] = {
            "sb": sandbox_id,
            "uid": pod_uid,
            "gen": generation,
            "iat": issued,
            "exp": issued + ttl_ms,
            "kid": self.key_id,
        }
        if presence is not None:
            fields.update(
                own=presence.owner,
                tier=presence.tier,
                cap=presence.capacity,
                ep=presence.endpoint,
            )
        payload = json.dumps(
            fields,
            separators=(",", ":"),
            sort_keys=True,
        ).encode()
        signature = self._key.sign(_CONTEXT + payload)
        return f"{_b64encode(payload)}.{_b64encode(signature)}"


def parse_public_keys(pem: bytes) -> dict[str, Ed25519PublicKey]:
    """Every Ed25519 public key in a file of concatenated PEM blocks, by key id."""
    keys: dict[str, Ed25519PublicKey] = {}
    marker = b"-----BEGIN PUBLIC KEY-----"
    for block in pem.split(marker)[1:]:
        key = serialization.load_pem_public_key(marker + block)
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError("a public key in the key set is not Ed25519")
        keys[key_id(key)] = key
    if not keys:
        raise ValueError("the key set holds no public key")
    return keys


class VerificationKeys:
    """The relay's key set, from a file of PEM public keys, re-read when it changes.

    The file is looked at (one ``stat``) at most once a second. A file that
    cannot be read or parsed keeps the last good key set, so a half-written
    file during a rotation never locks every worker out.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._keys = parse_public_keys(path.read_bytes())
        stat = path.stat()
        self._stamp = (stat.st_mtime_ns, stat.st_size)

    @property
    def key_ids(self) -> frozenset[str]:
        return frozenset(self._current())

    def refresh(self) -> None:
        """Look at the file now (a change is otherwise seen within a second)."""
        self._checked = 0.0
        self._current()

    def _current(self) -> dict[str, Ed25519PublicKey]:
        now = time.monotonic()
        if now - self._checked < _RELOAD_INTERVAL_S:
            return self._keys
        with self._lock:
            self._checked = now
            try:
                stat = self.path.stat()
                stamp = (stat.st_mtime_ns, stat.st_size)
                if stamp != self._stamp:
                    self._keys = parse_public_keys(self.path.read_bytes())
                    self._stamp = stamp
            except (OSError, ValueError):
                pass  # keep the last good key set
        return self._keys

    def verify(
        self, credential: str, sandbox_id: str, *, at_ms: int | None = None
    ) -> SandboxClaims:
        """The claims of ``credential`` if it proves it is ``sandbox_id``'s runtime now.

        Raises :class:`CredentialRefusedError`. Checks the signature before it
        believes anything in the payload.
        """
        if not credential:
            raise CredentialRefusedError("missing", "no sandbox credential was presented")
        if len(credential) > MAX_CREDENTIAL_CHARS:
            raise CredentialRefusedError("malformed", "the credential is too long")
        try:
            encoded_payload, encoded_signature = credential.split(".")
            payload = _b64decode(encoded_payload)
            signature = _b64decode(encoded_signature)
            fields = json.loads(payload)
            kid = fields["kid"]
            claims = SandboxClaims(
                sandbox_id=str(fields["sb"]),
                pod_uid=str(fields["uid"]),
                generation=str(fields["gen"]),
                issued_ms=int(fields["iat"]),
                expires_ms=int(fields["exp"]),
                key_id=str(kid),
                presence=_presence(fields),
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise CredentialRefusedError("malformed", "the credential does not parse") from None
        public_key = self._current().get(claims.key_id)
        if public_key is None:
            raise CredentialRefusedError(
                "unknown_key", f"the credential's signing key {claims.key_id!r} is not trusted"
            )
        try:
            public_key.verify(signature, _CONTEXT + payload)
        except InvalidSignature:
            raise CredentialRefusedError(
                "bad_signature", "the credential's signature does not verify"
            ) from None
        if claims.sandbox_id != sandbox_id:
            raise CredentialRefusedError(
                "wrong_sandbox", "the credential was issued for another sandbox"
            )
        now = now_ms() if at_ms is None else at_ms
        if claims.expires_ms <= now - CLOCK_SKEW_MS:
            raise CredentialRefusedError("expired", "the credential has expired")
        if claims.issued_ms > now + CLOCK_SKEW_MS:
            raise CredentialRefusedError("not_yet_valid", "the credential is not valid yet")
        if not claims.generation:
            raise CredentialRefusedError("malformed", "the credential names no generation")
        return claims


def _presence(fields: dict[str, object]) -> PresenceClaims | None:
    """The presence claims of a payload; None when it carries none (an old credential).
    Claims of the wrong type raise ValueError (the credential is malformed)."""
    if "cap" not in fields:
        return None
    owner, tier, capacity, endpoint = fields["own"], fields["tier"], fields["cap"], fields["ep"]
    if not (
        isinstance(owner, str)
        and isinstance(tier, str)
        and isinstance(endpoint, str)
        and isinstance(capacity, int)
        and not isinstance(capacity, bool)
        and capacity >= 1
    ):
        raise ValueError("presence claims of the wrong type")
    return PresenceClaims(owner, tier, capacity, endpoint)


def generate_key_pair(private_path: Path, public_path: Path) -> bool:
    """Write a new Ed25519 key pair (private key mode 0600) unless one exists.

    For the local stack and tests; production keys come from a Secret. Returns
    True when a new pair was written.
    """
    if private_path.exists() and public_path.exists():
        return False
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    write_private_file(private_path, private_pem)
    public_path.write_bytes(public_pem)
    return True


def write_private_file(path: Path, data: bytes, owner: tuple[int, int] | None = None) -> None:
    """Replace ``path`` atomically with ``data``, readable by its owner only (0600).

    A reader sees the old file or the new one, never half of one: the worker
    agent re-reads its credential file while the substrate renews it. ``owner``
    (uid, gid): the file is given to them before it is renamed into place (a
    runtime running as its own uid reads its credential, and no one else can;
    SPEC O4), so it is never readable by anyone else, even for an instant.
    """
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            if owner is not None:
                os.fchown(file.fileno(), *owner)
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


# -- the revocation record -------------------------------------------------------


def credential_key(prefix: str, sandbox_id: str) -> str:
    """The sandbox's credential record, as affinity's ``_lib.lua`` names it."""
    return f"{prefix}{{affinity}}:credential:{sandbox_id}"


@dataclass(frozen=True)
class Issued:
    """A credential just minted, with what it claims."""

    credential: str
    generation: str
    issued_ms: int
    expires_ms: int


class CredentialIssuer:
    """The substrate's side: mint, renew and revoke sandbox credentials.

    Each call is one bounded Redis command or script (the client's socket
    timeout bounds it). Records expire with the credentials they cover.
    """

    def __init__(
        self,
        signing_key: SigningKey,
        redis: aioredis.Redis | aioredis.RedisCluster,
        prefix: str,
        *,
        ttl_s: float,
    ) -> None:
        self.signing_key = signing_key
        self._redis = redis
        self._prefix = prefix
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self._renew = redis.register_script(
            read_script("turnstile_platform", "sandbox_credential_renew.lua")
        )
        self._revoke_generation = redis.register_script(
            read_script("turnstile_platform", "sandbox_credential_revoke.lua")
        )

    def _mint(
        self, sandbox_id: str, generation: str, pod_uid: str, presence: PresenceClaims | None
    ) -> Issued:
        issued = now_ms()
        credential = self.signing_key.mint(
            sandbox_id,
            generation=generation,
            ttl_ms=self.ttl_ms,
            pod_uid=pod_uid,
            issued_ms=issued,
            presence=presence,
        )
        return Issued(credential, generation, issued, issued + self.ttl_ms)

    async def issue(
        self,
        sandbox_id: str,
        *,
        presence: PresenceClaims | None = None,
        pod_uid: str = "",
        generation: str | None = None,
    ) -> Issued:
        """A credential for a new runtime: a new generation, recorded first.

        Recording replaces any earlier generation, so the credential of the
        sandbox's previous runtime stops working at once. ``generation``: one the
        caller derived (Kubernetes derives it from the activation, so a retried
        create of the same pod records the same one); None draws a random one.
        ``presence``: what the substrate started (SPEC O3).
        """
        issued = self._mint(sandbox_id, generation or new_generation(), pod_uid, presence)
        await self._redis.set(
            credential_key(self._prefix, sandbox_id), issued.generation, px=self.ttl_ms
        )
        return issued

    async def renew(
        self,
        sandbox_id: str,
        generation: str,
        *,
        presence: PresenceClaims | None = None,
        pod_uid: str = "",
    ) -> Issued | None:
        """A fresh credential for the same runtime, or None if it was revoked.

        The record is extended (or put back, if Redis lost it) only while it
        does not name another generation or ``revoked`` (one script), so a
        renewal racing a Deactivate never brings a revoked credential back, and
        renewing twice is harmless. ``presence`` is re-attested from the substrate's
        record (Kubernetes binds the pod IP here, once it is known).
        """
        issued = self._mint(sandbox_id, generation, pod_uid, presence)
        kept = await self._renew(
            keys=[credential_key(self._prefix, sandbox_id)], args=[generation, self.ttl_ms]
        )
        return issued if int(kept) == 1 else None

    async def revoke(self, sandbox_id: str) -> None:
        """The sandbox's credentials stop working (its runtime ended).

        A ``revoked`` record, not a deletion: a missing record means "unknown"
        to the relay (Redis lost its data) and would refuse nothing. It lives as
        long as any credential minted before it could.
        """
        await self._redis.set(credential_key(self._prefix, sandbox_id), REVOKED, px=self.ttl_ms)

    async def revoke_generation(self, sandbox_id: str, generation: str) -> bool:
        """Revoke ``generation``'s credentials only if it is still the sandbox's current
        runtime (one script); True when it was. For a sweep that finds a runtime gone
        without a Deactivate: a newer runtime of the sandbox is never cut off."""
        revoked = await self._revoke_generation(
            keys=[credential_key(self._prefix, sandbox_id)], args=[generation, self.ttl_ms]
        )
        return int(revoked) == 1
