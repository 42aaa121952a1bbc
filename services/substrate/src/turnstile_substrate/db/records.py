"""Sandbox records, executions and receipts: every statement the service runs.

Writes that belong together happen in one transaction: an activation writes the
sandbox's attribution, ends any stale execution, opens the new execution and,
on Direct, its receipt, all at once (SPEC A1, A3, S7), so a failure leaves no
row behind. The database itself enforces one active execution per sandbox
(``executions_one_active``) and the attribution format (A2).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import asyncpg

from turnstile_substrate.db.claims import Claim, fence
from turnstile_substrate.db.pool import Connection
from turnstile_substrate.runtime import CreateKind, Runtime

SandboxState = Literal["running", "stopped"]
ReceiptKind = Literal["start", "restore"]


@dataclass(frozen=True)
class Execution:
    """One runtime a sandbox had or has: a pod or a process."""

    id: int
    kind: str
    runtime_name: str
    node: str
    endpoint: str
    #: The runtime's client label, and so the attribution it carried (A3).
    client_label: str | None
    #: The bounded key admission charged when it was created.
    charged_key: str
    started_at: datetime
    ended_at: datetime | None


@dataclass(frozen=True)
class SandboxRecord:
    """A ``sandboxes`` row with its active execution, if any."""

    id: str
    tier: str
    state: SandboxState
    substrate: str
    activating_client_id: str | None
    created_at: datetime
    updated_at: datetime
    execution: Execution | None


_SELECT_SANDBOX = """
SELECT s.id, s.tier, s.state, s.substrate, s.activating_client_id, s.created_at, s.updated_at,
       e.id AS e_id, e.kind AS e_kind, e.runtime_name AS e_runtime_name, e.node AS e_node,
       e.endpoint AS e_endpoint, e.client_label AS e_client_label,
       e.charged_key AS e_charged_key, e.started_at AS e_started_at, e.ended_at AS e_ended_at
FROM sandboxes s
LEFT JOIN executions e ON e.sandbox_id = s.id AND e.ended_at IS NULL
"""


def _record(row: asyncpg.Record) -> SandboxRecord:
    execution = None
    if row["e_id"] is not None:
        execution = Execution(
            id=row["e_id"],
            kind=row["e_kind"],
            runtime_name=row["e_runtime_name"],
            node=row["e_node"],
            endpoint=row["e_endpoint"],
            client_label=row["e_client_label"],
            charged_key=row["e_charged_key"],
            started_at=row["e_started_at"],
            ended_at=row["e_ended_at"],
        )
    return SandboxRecord(
        id=row["id"],
        tier=row["tier"],
        state=row["state"],
        substrate=row["substrate"],
        activating_client_id=row["activating_client_id"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        execution=execution,
    )


async def fetch_sandbox(conn: Connection, sandbox_id: str) -> SandboxRecord | None:
    """The sandbox's record and active execution, or None if it has none."""
    row = await conn.fetchrow(_SELECT_SANDBOX + "WHERE s.id = $1", sandbox_id)
    return _record(row) if row is not None else None


async def fetch_owner(conn: Connection, sandbox_id: str) -> str | None:
    """The client the sandbox is recorded to (None: no record, or none recorded)."""
    owner: str | None = await conn.fetchval(
        "SELECT activating_client_id FROM sandboxes WHERE id = $1", sandbox_id
    )
    return owner


async def activation_generation(conn: Connection, sandbox_id: str) -> int:
    """How many executions the sandbox has had: the number of its next activation.

    Every activation that made a runtime recorded an execution, so a retry of an activation
    that failed (or is still in flight on another replica) reads the same number.
    """
    count = await conn.fetchval("SELECT count(*) FROM executions WHERE sandbox_id = $1", sandbox_id)
    return int(count or 0)


async def record_activation(
    conn: Connection,
    runtime: Runtime,
    *,
    substrate: str,
    charged_key: str,
    receipt: ReceiptKind | None,
    claim: Claim | None = None,
) -> SandboxRecord:
    """Record that ``runtime`` now runs the sandbox, in one transaction.

    With ``claim``, the transaction first checks that the activation still holds the
    sandbox's claim (:func:`~turnstile_substrate.db.claims.fence`) and writes nothing,
    raising :class:`~turnstile_substrate.db.claims.ClaimLostError`, if it does not.

    ``activating_client_id`` takes the runtime's client label, so record and
    label always hold the same value: an inheriting activation of a NULL record
    runs an unlabelled runtime and the record stays NULL (A4). A new sandbox
    takes the runtime's tier; an existing one keeps its own. An execution still
    marked active (its runtime died without a Deactivate) is ended first.
    """
    async with conn.transaction():
        if claim is not None:
            await fence(conn, claim)
        await conn.execute(
            """
            INSERT INTO sandboxes (id, tier, state, substrate, activating_client_id)
            VALUES ($1, $2, 'running', $3, $4)
            ON CONFLICT (id) DO UPDATE
               SET state = 'running',
                   substrate = EXCLUDED.substrate,
                   activating_client_id = EXCLUDED.activating_client_id,
                   updated_at = now()
            """,
            runtime.sandbox_id,
            runtime.tier,
            substrate,
            runtime.client_label,
        )
        await conn.execute(
            """
            UPDATE executions SET ended_at = now(), end_reason = 'superseded'
            WHERE sandbox_id = $1 AND ended_at IS NULL
            """,
            runtime.sandbox_id,
        )
        execution_id = await conn.fetchval(
            """
            INSERT INTO executions
                (sandbox_id, substrate, kind, runtime_name, node, endpoint, client_label,
                 charged_key)
            VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
            RETURNING id
            """,
            runtime.sandbox_id,
            substrate,
            runtime.kind.value,
            runtime.name,
            runtime.node,
            runtime.endpoint,
            runtime.client_label,
            charged_key,
        )
        if receipt is not None:
            await conn.execute(
                """
                INSERT INTO receipts
                    (sandbox_id, execution_id, kind, client_id, charged_key, runtime_name)
                VALUES ($1, $2, $3, $4, $5, $6)
                """,
                runtime.sandbox_id,
                execution_id,
                receipt,
                runtime.client_label,
                charged_key,
                runtime.name,
            )
        record = await fetch_sandbox(conn, runtime.sandbox_id)
    assert record is not None
    return record


async def adopt_runtime(
    conn: Connection, runtime: Runtime, *, substrate: str, claim: Claim | None = None
) -> SandboxRecord:
    """Repair the record of a runtime that runs without one (its activation died
    between creating it and recording it): the record follows the runtime's
    label, as it would have. No receipt: nothing was started now."""
    return await record_activation(
        conn, runtime, substrate=substrate, charged_key="", receipt=None, claim=claim
    )


async def end_execution(
    conn: Connection, sandbox_id: str, *, reason: str, claim: Claim | None = None
) -> bool:
    """End the sandbox's active execution and mark it stopped; False if none was active.

    The attribution stays: it says who last created the runtime, and an
    inheriting activation of the stopped sandbox charges that client (C4). With
    ``claim``, fenced as :func:`record_activation` is.
    """
    async with conn.transaction():
        if claim is not None:
            await fence(conn, claim)
        ended = await conn.fetchval(
            """
            UPDATE executions SET ended_at = now(), end_reason = $2
            WHERE sandbox_id = $1 AND ended_at IS NULL
            RETURNING id
            """,
            sandbox_id,
            reason,
        )
        await conn.execute(
            """
            UPDATE sandboxes SET state = 'stopped', updated_at = now()
            WHERE id = $1 AND state <> 'stopped'
            """,
            sandbox_id,
        )
    return ended is not None


@dataclass(frozen=True)
class ActiveRuntime:
    """An execution still marked active: the runtime the record says the sandbox has."""

    sandbox_id: str
    runtime_name: str
    started_at: datetime


async def active_runtimes(conn: Connection, substrate: str) -> dict[str, ActiveRuntime]:
    """Every active execution of ``substrate``, by runtime name (what the sweeps compare
    the pods with)."""
    rows = await conn.fetch(
        """
        SELECT sandbox_id, runtime_name, started_at FROM executions
        WHERE ended_at IS NULL AND substrate = $1
        """,
        substrate,
    )
    return {
        row["runtime_name"]: ActiveRuntime(
            row["sandbox_id"], row["runtime_name"], row["started_at"]
        )
        for row in rows
    }


async def runtime_is_recorded(conn: Connection, sandbox_id: str, runtime_name: str) -> bool:
    """Whether ``runtime_name`` is the sandbox's active execution right now."""
    found = await conn.fetchval(
        """
        SELECT 1 FROM executions
        WHERE sandbox_id = $1 AND runtime_name = $2 AND ended_at IS NULL
        """,
        sandbox_id,
        runtime_name,
    )
    return found is not None


async def end_runtime(conn: Connection, sandbox_id: str, runtime_name: str, *, reason: str) -> bool:
    """End the execution of ``runtime_name`` if it is still the sandbox's active one, and mark
    the sandbox stopped; False when it no longer was (a newer activation is left alone)."""
    async with conn.transaction():
        ended = await conn.fetchval(
            """
            UPDATE executions SET ended_at = now(), end_reason = $3
            WHERE sandbox_id = $1 AND runtime_name = $2 AND ended_at IS NULL
            RETURNING id
            """,
            sandbox_id,
            runtime_name,
            reason,
        )
        if ended is not None:
            await conn.execute(
                """
                UPDATE sandboxes SET state = 'stopped', updated_at = now()
                WHERE id = $1 AND state <> 'stopped'
                """,
                sandbox_id,
            )
    return ended is not None


async def list_sandboxes(
    conn: Connection,
    *,
    limit: int,
    after: tuple[datetime, str] | None,
    client_id: str | None,
) -> list[SandboxRecord]:
    """Up to ``limit`` records, newest first, strictly after the ``after`` cursor
    (``created_at``, ``id``), optionally only those recorded for ``client_id``."""
    conditions: list[str] = []
    args: list[object] = []
    if client_id is not None:
        args.append(client_id)
        conditions.append(f"s.activating_client_id = ${len(args)}")
    if after is not None:
        args.extend(after)
        conditions.append(f"(s.created_at, s.id) < (${len(args) - 1}, ${len(args)})")
    where = f"WHERE {' AND '.join(conditions)} " if conditions else ""
    args.append(limit)
    rows = await conn.fetch(
        _SELECT_SANDBOX + where + f"ORDER BY s.created_at DESC, s.id DESC LIMIT ${len(args)}",
        *args,
    )
    return [_record(row) for row in rows]


def receipt_kind(kind: CreateKind) -> ReceiptKind:
    """The receipt a Direct runtime's creation writes (S7)."""
    return "restore" if kind is CreateKind.RESTORE else "start"
