"""Secrets stay out of messages (SPEC Z4): a settings-validation error never echoes a
URL's password, the settings' repr leaves URLs out, and passwords come from files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from turnstile_platform.redis_client import BoundedRedis, redis_from_settings
from turnstile_platform.settings import ServiceSettings, redact_url
from turnstile_testing.probe import settings

SECRET = "s3cret-Pa55"


def _url(text: str) -> Any:
    """A URL as the environment gives it: a string, validated by the settings."""
    return text


def test_a_validation_error_does_not_print_the_urls_password() -> None:
    with pytest.raises(ValidationError) as invalid:
        ServiceSettings(redis_url=_url(f"redis://app:{SECRET}@redis:notaport/0"))
    message = str(invalid.value)
    assert "redis_url" in message
    assert SECRET not in message
    assert SECRET not in repr(invalid.value.errors(include_input=False))


def test_an_invalid_url_from_the_environment_is_not_echoed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TURNSTILE_REDIS_URL", f"http://app:{SECRET}@redis:6379/0")
    with pytest.raises(ValidationError) as invalid:
        ServiceSettings()
    assert SECRET not in str(invalid.value)


def test_the_settings_repr_leaves_urls_out() -> None:
    loaded = ServiceSettings(redis_url=_url(f"rediss://app:{SECRET}@redis:6380/0"))
    assert SECRET not in repr(loaded)
    assert SECRET not in str(loaded)


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url(f"rediss://app:{SECRET}@redis:6380/0") == "rediss://app:***@redis:6380/0"
    assert redact_url("redis://redis:6379/0") == "redis://redis:6379/0"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"


async def test_the_redis_acl_user_and_password_file_reach_the_connection(
    tmp_path: Path, single_redis_url: str
) -> None:
    password = tmp_path / "redis-password"
    password.write_text(f"{SECRET}\n")
    client = redis_from_settings(
        settings(
            redis_url=single_redis_url, redis_username="turnstile", redis_password_file=password
        )
    )
    try:
        assert isinstance(client, BoundedRedis)
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["username"] == "turnstile"
        assert kwargs["password"] == SECRET
    finally:
        await client.aclose()
    plain = redis_from_settings(settings(redis_url=single_redis_url))
    try:
        assert await plain.ping()
    finally:
        await plain.aclose()
