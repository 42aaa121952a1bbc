"""Sandbox credentials (SPEC Z3): what a credential proves, and what revokes it."""

from __future__ import annotations

import asyncio
import base64
import json
import stat
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from turnstile_platform.sandbox_credentials import (
    CLOCK_SKEW_MS,
    REVOKED,
    CredentialIssuer,
    CredentialRefusedError,
    PresenceClaims,
    SigningKey,
    VerificationKeys,
    credential_key,
    generate_key_pair,
    now_ms,
    write_private_file,
)

HOUR_MS = 3_600_000


@pytest.fixture
def pair(tmp_path: Path) -> tuple[SigningKey, VerificationKeys]:
    private, public = tmp_path / "signing.pem", tmp_path / "public.pem"
    assert generate_key_pair(private, public)
    return SigningKey.from_file(private), VerificationKeys(public)


def refused(keys: VerificationKeys, credential: str, sandbox_id: str, **kw: int) -> str:
    with pytest.raises(CredentialRefusedError) as raised:
        keys.verify(credential, sandbox_id, **kw)
    return raised.value.reason


def test_a_credential_proves_its_sandbox_generation_and_expiry(
    pair: tuple[SigningKey, VerificationKeys],
) -> None:
    signing, keys = pair
    credential = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS, pod_uid="uid-1")
    claims = keys.verify(credential, "sb-a")
    assert (claims.sandbox_id, claims.pod_uid, claims.generation) == ("sb-a", "uid-1", "g1")
    assert claims.expires_ms - claims.issued_ms == HOUR_MS
    assert claims.key_id == signing.key_id


def test_a_credential_attests_the_presence_it_was_minted_with(
    pair: tuple[SigningKey, VerificationKeys],
) -> None:
    signing, keys = pair
    started = PresenceClaims("acme", "container", 2, "10.0.0.5:8080")
    credential = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS, presence=started)
    assert keys.verify(credential, "sb-a").presence == started
    ownerless = PresenceClaims("", "", 1, "")
    credential = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS, presence=ownerless)
    assert keys.verify(credential, "sb-a").presence == ownerless


def test_an_old_credential_without_presence_claims_still_verifies_as_ownerless(
    pair: tuple[SigningKey, VerificationKeys],
) -> None:
    signing, keys = pair
    credential = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS)
    assert keys.verify(credential, "sb-a").presence is None


@pytest.mark.parametrize(
    "claims",
    [
        {"own": 1, "tier": "t", "cap": 1, "ep": ""},
        {"own": "a", "tier": "t", "cap": "1", "ep": ""},
        {"own": "a", "tier": "t", "cap": True, "ep": ""},
        {"own": "a", "tier": "t", "cap": 0, "ep": ""},
        {"own": "a", "tier": "t", "cap": 1},
    ],
)
def test_presence_claims_of_the_wrong_shape_are_malformed_even_when_signed(
    pair: tuple[SigningKey, VerificationKeys], claims: dict[str, object]
) -> None:
    from turnstile_platform import sandbox_credentials as module

    signing, keys = pair
    fields = {"sb": "sb-a", "uid": "", "gen": "g", "iat": now_ms(), "exp": now_ms() + HOUR_MS}
    payload = json.dumps({**fields, "kid": signing.key_id, **claims}).encode()
    signature = signing._key.sign(module._CONTEXT + payload)
    credential = f"{module._b64encode(payload)}.{module._b64encode(signature)}"
    assert refused(keys, credential, "sb-a") == "malformed"


def test_a_credential_for_another_sandbox_is_refused(
    pair: tuple[SigningKey, VerificationKeys],
) -> None:
    signing, keys = pair
    credential = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS)
    assert refused(keys, credential, "sb-b") == "wrong_sandbox"


def test_an_expired_or_future_credential_is_refused_past_the_clock_skew(
    pair: tuple[SigningKey, VerificationKeys],
) -> None:
    signing, keys = pair
    issued = now_ms() - 2 * HOUR_MS
    old = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS, issued_ms=issued)
    assert refused(keys, old, "sb-a") == "expired"
    # Within the tolerated skew it still verifies.
    keys.verify(old, "sb-a", at_ms=issued + HOUR_MS + CLOCK_SKEW_MS - 1)
    future = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS, issued_ms=now_ms() + HOUR_MS)
    assert refused(keys, future, "sb-a") == "not_yet_valid"


def test_forged_credentials_are_refused(pair: tuple[SigningKey, VerificationKeys]) -> None:
    signing, keys = pair
    genuine = signing.mint("sb-a", generation="g1", ttl_ms=HOUR_MS)
    payload, signature = genuine.split(".")
    # Another sandbox id under the genuine signature.
    fields = json.loads(base64.urlsafe_b64decode(payload + "=="))
    fields["sb"] = "sb-b"
    edited = base64.urlsafe_b64encode(json.dumps(fields).encode()).rstrip(b"=").decode()
    assert refused(keys, f"{edited}.{signature}", "sb-b") == "bad_signature"
    # A key the relay does not trust, naming itself...
    stranger = SigningKey(Ed25519PrivateKey.generate())
    assert refused(keys, stranger.mint("sb-a", generation="g", ttl_ms=HOUR_MS), "sb-a") == (
        "unknown_key"
    )
    # ...or claiming the trusted key's id.
    stranger.key_id = signing.key_id
    forged = stranger.mint("sb-a", generation="g", ttl_ms=HOUR_MS)
    assert refused(keys, forged, "sb-a") == "bad_signature"


@pytest.mark.parametrize(
    ("credential", "reason"),
    [
        ("", "missing"),
        ("no-dot", "malformed"),
        ("a.b.c", "malformed"),
        ("!!!.???", "malformed"),
        (base64.urlsafe_b64encode(b"[1,2]").decode() + ".AAAA", "malformed"),
        ("x" * 5000, "malformed"),
    ],
)
def test_malformed_credentials_are_refused(
    pair: tuple[SigningKey, VerificationKeys], credential: str, reason: str
) -> None:
    assert refused(pair[1], credential, "sb-a") == reason


def test_the_key_set_accepts_every_listed_key_and_follows_the_file(tmp_path: Path) -> None:
    old_private, old_public = tmp_path / "old.pem", tmp_path / "old.pub"
    new_private, new_public = tmp_path / "new.pem", tmp_path / "new.pub"
    generate_key_pair(old_private, old_public)
    generate_key_pair(new_private, new_public)
    old, new = SigningKey.from_file(old_private), SigningKey.from_file(new_private)
    keyset = tmp_path / "keys.pem"
    keyset.write_bytes(old_public.read_bytes())
    keys = VerificationKeys(keyset)
    assert refused(keys, new.mint("s", generation="g", ttl_ms=HOUR_MS), "s") == "unknown_key"

    # Rotation, step 1: both keys trusted.
    keyset.write_bytes(old_public.read_bytes() + new_public.read_bytes())
    keys.refresh()
    assert keys.key_ids == {old.key_id, new.key_id}
    keys.verify(new.mint("s", generation="g", ttl_ms=HOUR_MS), "s")
    keys.verify(old.mint("s", generation="g", ttl_ms=HOUR_MS), "s")

    # A broken file keeps the last good key set.
    keyset.write_text("-----BEGIN PUBLIC KEY-----\ngarbage\n-----END PUBLIC KEY-----\n")
    keys.refresh()
    assert keys.key_ids == {old.key_id, new.key_id}

    # Step 3: the old key is dropped.
    keyset.write_bytes(new_public.read_bytes())
    keys.refresh()
    assert refused(keys, old.mint("s", generation="g", ttl_ms=HOUR_MS), "s") == "unknown_key"


def test_key_and_credential_files_are_private(tmp_path: Path) -> None:
    private, public = tmp_path / "k" / "signing.pem", tmp_path / "k" / "public.pem"
    assert generate_key_pair(private, public)
    assert not generate_key_pair(private, public)  # kept, never regenerated
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    write_private_file(tmp_path / "credential", b"one")
    write_private_file(tmp_path / "credential", b"two")
    assert (tmp_path / "credential").read_bytes() == b"two"
    assert stat.S_IMODE((tmp_path / "credential").stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


async def test_issue_renew_and_revoke_keep_the_record_and_never_revive_a_revoked_one(
    pair: tuple[SigningKey, VerificationKeys], redis: aioredis.Redis, redis_prefix: str
) -> None:
    signing, keys = pair
    issuer = CredentialIssuer(signing, redis, redis_prefix, ttl_s=3600)
    key = credential_key(redis_prefix, "sb-a")
    first = await issuer.issue("sb-a")
    assert keys.verify(first.credential, "sb-a").generation == first.generation
    assert await redis.get(key) == first.generation.encode()
    assert 0 < await redis.pttl(key) <= HOUR_MS

    renewed = await issuer.renew("sb-a", first.generation)
    assert renewed is not None
    assert renewed.generation == first.generation
    assert keys.verify(renewed.credential, "sb-a").expires_ms >= first.expires_ms

    # A new runtime: a new generation; the old one can no longer renew.
    second = await issuer.issue("sb-a")
    assert second.generation != first.generation
    assert await issuer.renew("sb-a", first.generation) is None
    assert await redis.get(key) == second.generation.encode()

    # Redis lost the record: the renewal of the running runtime puts it back.
    await redis.delete(key)
    assert await issuer.renew("sb-a", second.generation) is not None
    assert await redis.get(key) == second.generation.encode()

    # Revoked: a tombstone that outlives every credential minted before it.
    await issuer.revoke("sb-a")
    assert await redis.get(key) == REVOKED.encode()
    assert 0 < await redis.pttl(key) <= HOUR_MS
    assert await issuer.renew("sb-a", second.generation) is None
    assert await redis.get(key) == REVOKED.encode()


async def test_a_renewal_racing_a_revocation_never_leaves_the_credential_working(
    pair: tuple[SigningKey, VerificationKeys], redis: aioredis.Redis, redis_prefix: str
) -> None:
    signing, _ = pair
    issuer = CredentialIssuer(signing, redis, redis_prefix, ttl_s=3600)
    for n in range(50):
        sandbox_id = f"sb-{n}"
        issued = await issuer.issue(sandbox_id)
        await asyncio.gather(
            issuer.renew(sandbox_id, issued.generation),
            issuer.revoke(sandbox_id),
            issuer.renew(sandbox_id, issued.generation),
        )
        assert await redis.get(credential_key(redis_prefix, sandbox_id)) == REVOKED.encode()


async def test_revoking_a_generation_never_cuts_off_a_newer_runtime(
    pair: tuple[SigningKey, VerificationKeys], redis: aioredis.Redis, redis_prefix: str
) -> None:
    signing, _ = pair
    issuer = CredentialIssuer(signing, redis, redis_prefix, ttl_s=3600)
    key = credential_key(redis_prefix, "sb-a")
    old = await issuer.issue("sb-a")
    new = await issuer.issue("sb-a")

    assert await issuer.revoke_generation("sb-a", old.generation) is False
    assert await redis.get(key) == new.generation.encode()

    assert await issuer.revoke_generation("sb-a", new.generation) is True
    assert await redis.get(key) == REVOKED.encode()
    assert 0 < await redis.pttl(key) <= HOUR_MS
    assert await issuer.revoke_generation("sb-a", new.generation) is False

    await redis.delete(key)
    assert await issuer.revoke_generation("sb-a", new.generation) is False
    assert await redis.get(key) is None
