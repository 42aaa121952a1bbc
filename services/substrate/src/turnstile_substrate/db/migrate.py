"""``turnstile-migrate``: apply the substrate's schema migrations (SPEC A5).

The migrations are plain SQL files in :mod:`turnstile_substrate.db.migrations`,
applied in dependency order by yoyo-migrations, which records what it applied
in its own tables and holds a lock while it works: running the command again,
or from two places at once, applies each migration exactly once. Each SQL file
is also written to be safe to re-run on its own (``IF NOT EXISTS``), because
yoyo marks a migration applied in a transaction of its own after running it.

The service never migrates on start-up: the schema changes once, from one
command (a Kubernetes Job or ``turnstile-migrate`` locally), not from every
replica at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib import resources

from yoyo import get_backend, read_migrations

from turnstile_substrate.settings import SubstrateSettings

log = logging.getLogger(__name__)

MIGRATIONS_PACKAGE = "turnstile_substrate.db"


def migrations_dir() -> str:
    """The directory of the SQL migration files shipped with the package."""
    return str(resources.files(MIGRATIONS_PACKAGE) / "migrations")


def yoyo_url(database_url: str) -> str:
    """The yoyo backend URL (Psycopg 3 driver) for a ``postgresql://`` URL."""
    scheme, sep, rest = database_url.partition("://")
    if not sep or scheme not in {"postgres", "postgresql"}:
        raise ValueError("database URL must start with postgresql:// or postgres://")
    return f"postgresql+psycopg://{rest}"


def apply_migrations(
    database_url: str, *, upto: str | None = None, lock_timeout_s: float = 60.0
) -> list[str]:
    """Apply every migration not yet applied (or only those up to ``upto``,
    inclusive, by id); returns the ids applied, in order."""
    backend = get_backend(yoyo_url(database_url))
    try:
        migrations = read_migrations(migrations_dir())
        if upto is not None:
            ids = [m.id for m in migrations]
            if upto not in ids:
                raise ValueError(f"no migration {upto!r}; known: {', '.join(ids)}")
            migrations = migrations.filter(lambda m: ids.index(m.id) <= ids.index(upto))
        with backend.lock(timeout=lock_timeout_s):
            pending = backend.to_apply(migrations)
            applied = [m.id for m in pending]
            backend.apply_migrations(pending)
        return applied
    finally:
        backend.connection.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Apply the migrations to ``TURNSTILE_DATABASE_URL`` (or ``--database-url``)."""
    parser = argparse.ArgumentParser(
        prog="turnstile-migrate",
        description="Apply the substrate's PostgreSQL migrations (idempotent).",
    )
    parser.add_argument("--database-url", help="default: TURNSTILE_DATABASE_URL")
    parser.add_argument("--upto", help="apply migrations up to this id only")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    url = args.database_url or str(SubstrateSettings().database_url)
    try:
        applied = apply_migrations(url, upto=args.upto)
    except Exception as error:
        log.error("migration failed: %s", error)
        return 1
    if applied:
        log.info("applied %d migration(s): %s", len(applied), ", ".join(applied))
    else:
        log.info("schema is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
