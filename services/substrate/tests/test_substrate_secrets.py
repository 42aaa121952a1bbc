"""PostgreSQL credentials and TLS (SPEC Z4): the password comes from a file, sslmode
from a setting, and neither the URL's password nor the file's appears in errors."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from turnstile_substrate.db.pool import connection_options, create_pool
from turnstile_substrate.settings import SubstrateSettings

SECRET = "s3cret-Pa55"


def _url(text: str) -> Any:
    """A URL as the environment gives it: a string, validated by the settings."""
    return text


def test_a_validation_error_does_not_print_the_database_password() -> None:
    with pytest.raises(ValidationError) as invalid:
        SubstrateSettings(database_url=_url(f"mysql://app:{SECRET}@db:5432/turnstile"))
    assert "database_url" in str(invalid.value)
    assert SECRET not in str(invalid.value)
    loaded = SubstrateSettings(database_url=_url(f"postgresql://app:{SECRET}@db:5432/turnstile"))
    assert SECRET not in repr(loaded)


def test_password_file_and_verify_full_build_the_connection_options(tmp_path: Path) -> None:
    password = tmp_path / "pg-password"
    password.write_text(SECRET + "\n")
    options = connection_options(
        SubstrateSettings(database_password_file=password, database_sslmode="verify-full")
    )
    assert options["password"] == SECRET
    context = options["ssl"]
    assert isinstance(context, ssl.SSLContext)
    assert context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert (
        connection_options(SubstrateSettings(database_sslmode="verify-ca"))["ssl"].check_hostname
        is False
    )
    assert connection_options(SubstrateSettings(database_sslmode="disable")) == {"ssl": "disable"}


async def test_a_pool_connects_with_the_password_from_its_file(
    tmp_path: Path, migrated_url: str
) -> None:
    password = tmp_path / "pg-password"
    password.write_text("unused-by-trust-auth\n")
    pool = await create_pool(
        SubstrateSettings(
            database_url=_url(migrated_url),
            database_password_file=password,
            database_sslmode="disable",
        )
    )
    try:
        assert await pool.fetchval("SELECT 1") == 1
    finally:
        await pool.close()
