"""The statements of activation claims (migration ``0005_activation_claims``).

Each is one short statement, so it works through PgBouncer in transaction mode:
nothing here needs the same database session twice. Expiries use the database's
``clock_timestamp()``, one clock for every replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from turnstile_substrate.db.pool import Connection


@dataclass(frozen=True)
class Claim:
    """A claim this process holds: the sandbox and the owner token written in its row."""

    sandbox_id: str
    #: ``<host>/<pid>/<attempt>``: unique per attempt, readable by an operator.
    owner: str


class ClaimLostError(Exception):
    """The claim expired and another owner took it: this attempt must not write."""

    def __init__(self, claim: Claim) -> None:
        super().__init__(f"the activation claim of sandbox {claim.sandbox_id!r} was taken over")
        self.claim = claim


async def try_claim(conn: Connection, claim: Claim, ttl_s: float) -> bool:
    """Take the sandbox's claim if nobody holds it, its holder's expired, or it is already
    this claim's (a retry of a statement whose answer was lost); False if another holds it."""
    taken = await conn.fetchval(
        """
        INSERT INTO activation_claims AS c (sandbox_id, owner, expires_at)
        VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3))
        ON CONFLICT (sandbox_id) DO UPDATE
           SET owner = EXCLUDED.owner, claimed_at = now(), expires_at = EXCLUDED.expires_at
         WHERE c.expires_at < clock_timestamp() OR c.owner = EXCLUDED.owner
        RETURNING 1
        """,
        claim.sandbox_id,
        claim.owner,
        ttl_s,
    )
    return taken is not None


async def renew(conn: Connection, claim: Claim, ttl_s: float) -> bool:
    """Push the claim's expiry ``ttl_s`` ahead; False if another owner holds it now."""
    renewed = await conn.fetchval(
        """
        UPDATE activation_claims SET expires_at = clock_timestamp() + make_interval(secs => $3)
        WHERE sandbox_id = $1 AND owner = $2
        RETURNING 1
        """,
        claim.sandbox_id,
        claim.owner,
        ttl_s,
    )
    return renewed is not None


async def release(conn: Connection, claim: Claim) -> None:
    """Delete the claim if it is still ours (a taken-over claim is the new owner's)."""
    await conn.execute(
        "DELETE FROM activation_claims WHERE sandbox_id = $1 AND owner = $2",
        claim.sandbox_id,
        claim.owner,
    )


async def fence(conn: Connection, claim: Claim) -> None:
    """Inside a transaction: raise :class:`ClaimLostError` unless the claim is still ours,
    and lock its row until the transaction ends, so it cannot be taken over meanwhile.

    An expired claim nobody took is still ours: only an overwrite ends it, and one that
    comes after this check waits for the transaction (the row lock).
    """
    held = await conn.fetchval(
        """
        SELECT 1 FROM activation_claims WHERE sandbox_id = $1 AND owner = $2 FOR UPDATE
        """,
        claim.sandbox_id,
        claim.owner,
    )
    if held is None:
        raise ClaimLostError(claim)


async def in_progress(conn: Connection, sandbox_id: str) -> bool:
    """Whether an unexpired claim says an activation of the sandbox is under way."""
    found = await conn.fetchval(
        """
        SELECT 1 FROM activation_claims
        WHERE sandbox_id = $1 AND expires_at >= clock_timestamp()
        """,
        sandbox_id,
    )
    return found is not None


async def delete_expired(conn: Connection, expired_for_s: float, limit: int) -> int:
    """Delete at most ``limit`` claims whose expiry passed more than ``expired_for_s``
    ago (their owners died mid-activation and nobody activated the sandbox since);
    returns how many. Rows another statement has locked (a fence) are skipped."""
    deleted = await conn.fetchval(
        """
        WITH stale AS (
            SELECT sandbox_id FROM activation_claims
            WHERE expires_at < clock_timestamp() - make_interval(secs => $1)
            ORDER BY expires_at
            LIMIT $2
            FOR UPDATE SKIP LOCKED
        ), gone AS (
            DELETE FROM activation_claims c USING stale
            WHERE c.sandbox_id = stale.sandbox_id
              AND c.expires_at < clock_timestamp() - make_interval(secs => $1)
            RETURNING 1
        )
        SELECT count(*) FROM gone
        """,
        expired_for_s,
        limit,
    )
    return int(deleted or 0)
