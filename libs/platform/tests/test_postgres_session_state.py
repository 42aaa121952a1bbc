"""A tripwire for the pool's cheap release (``turnstile_platform.postgres``): a released
connection is reset only when marked as holding session state, so SQL that leaves state on
the session past its transaction must live in a module that marks its connection
(``mark_session_state``). This test reads every service and library module's SQL (its
string literals, docstrings aside) and fails on session-state SQL in a module that never
marks. Only modules that talk to PostgreSQL are read (they import asyncpg or the
substrate's ``db`` package): elsewhere "set" is English or a CLI verb.

It reads source, so it catches what is written, not what a string built at run time
could say; the statements it looks for are few and recognisable."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ("libs/*/src", "services/*/src", "tools/*/src")

#: Session-level SQL, by what it leaves behind; each pattern is matched against the start
#: of one statement (a literal split at ``;``), case-insensitively, or anywhere for calls.
_STATEMENT_START = {
    "a session GUC (SET without LOCAL)": re.compile(
        r"SET\s+(?!LOCAL\b|TRANSACTION\b|CONSTRAINTS\b)", re.IGNORECASE
    ),
    "a LISTEN registration": re.compile(r"LISTEN\b", re.IGNORECASE),
}
_ANYWHERE = {
    "a session advisory lock": re.compile(
        r"\bpg_(try_)?advisory_lock(_shared)?\s*\(", re.IGNORECASE
    ),
    "a session GUC (set_config, not local)": re.compile(
        r"\bset_config\s*\([^)]*,\s*false\s*\)", re.IGNORECASE
    ),
    "a cursor WITH HOLD": re.compile(r"\bWITH\s+HOLD\b", re.IGNORECASE),
}


def session_state_sql(text: str) -> list[str]:
    """What session state the SQL ``text`` would leave (empty: none)."""
    found = [what for what, pattern in _ANYWHERE.items() if pattern.search(text)]
    for statement in text.split(";"):
        found += [
            what for what, pattern in _STATEMENT_START.items() if pattern.match(statement.strip())
        ]
    return found


def string_literals(tree: ast.Module) -> list[ast.Constant]:
    """The module's string constants, without its docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    ]


def unmarked_session_state(path: Path) -> list[str]:
    """``file:line: what`` for each session-state literal of a module that never marks."""
    source = path.read_text()
    if "mark_session_state(" in source:
        return []
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {what}"
        for node in string_literals(ast.parse(source))
        for what in session_state_sql(str(node.value))
    ]


def talks_to_postgres(path: Path) -> bool:
    source = path.read_text()
    return "asyncpg" in source or "turnstile_substrate.db" in source


def modules() -> list[Path]:
    """The service and library modules that talk to PostgreSQL."""
    every = (path for pattern in SOURCES for path in ROOT.glob(f"{pattern}/**/*.py"))
    return sorted(path for path in every if talks_to_postgres(path))


def test_no_module_leaves_session_state_on_a_pooled_connection_without_marking_it() -> None:
    paths = modules()
    scanned = {str(path.relative_to(ROOT)) for path in paths}
    db = "services/substrate/src/turnstile_substrate/db"
    assert {f"{db}/records.py", f"{db}/claims.py", f"{db}/pool.py"} <= scanned
    assert "libs/platform/src/turnstile_platform/postgres.py" in scanned
    assert [finding for path in paths for finding in unmarked_session_state(path)] == []


@pytest.mark.parametrize(
    ("sql", "what"),
    [
        ("SELECT pg_advisory_lock($1)", "a session advisory lock"),
        ("SELECT pg_try_advisory_lock_shared(hashtext($1))", "a session advisory lock"),
        ("SET statement_timeout = '1s'", "a session GUC (SET without LOCAL)"),
        ("BEGIN;\n  set search_path TO x", "a session GUC (SET without LOCAL)"),
        ("SET SESSION ROLE reader", "a session GUC (SET without LOCAL)"),
        ("SELECT set_config('a.b', $1, false)", "a session GUC (set_config, not local)"),
        ("LISTEN sandbox_events", "a LISTEN registration"),
        ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", "a cursor WITH HOLD"),
    ],
)
def test_the_tripwire_recognises_session_state_sql(sql: str, what: str) -> None:
    assert session_state_sql(sql) == [what]


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT pg_advisory_xact_lock($1)",
        "SET LOCAL statement_timeout = '1s'",
        "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        "UPDATE sandboxes SET state = 'running' WHERE id = $1",
        "SELECT set_config('a.b', $1, true)",
        "DECLARE c CURSOR FOR SELECT 1",
        "SELECT 1 FROM activation_claims WHERE sandbox_id = $1 FOR UPDATE",
    ],
)
def test_the_tripwire_passes_transaction_scoped_sql(sql: str) -> None:
    assert session_state_sql(sql) == []


def test_the_tripwire_reads_literals_not_docstrings(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        '"""LISTEN/NOTIFY would need a session."""\n'
        "async def f(conn):\n"
        '    """Takes SET-free locks."""\n'
        '    await conn.execute("SELECT pg_advisory_lock(1)")\n'
    )
    tree = ast.parse(module.read_text())
    found = [w for node in string_literals(tree) for w in session_state_sql(str(node.value))]
    assert found == ["a session advisory lock"]
