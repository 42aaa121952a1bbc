"""The redis-py the client relies on: within the pinned range, with every private
attribute the adapter uses, and reached from the adapter only.

An upgrade of redis-py that moves one of them fails here (and the process at
start, :func:`~turnstile_platform.redis_internals.verify`), not under load."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from redis.asyncio.connection import ConnectionPool

from turnstile_platform import redis_internals
from turnstile_platform.redis_internals import PRIVATE, TESTED, RedisInternalsError, verify

SOURCES = Path(redis_internals.__file__).parent


def _pinned() -> Requirement:
    requires = metadata.requires("turnstile-platform") or []
    return next(Requirement(line) for line in requires if Requirement(line).name == "redis")


def test_the_installed_redis_py_is_in_the_tested_range() -> None:
    installed = Version(metadata.version("redis"))
    (low_major, low_minor), (high_major, high_minor) = TESTED
    assert Version(f"{low_major}.{low_minor}") <= installed < Version(f"{high_major}.{high_minor}")


def test_the_package_metadata_pins_the_tested_range() -> None:
    (low_major, low_minor), (high_major, high_minor) = TESTED
    specifier = _pinned().specifier
    assert str(specifier) == f"<{high_major}.{high_minor},>={low_major}.{low_minor}"


def test_the_lock_pins_the_tested_range() -> None:
    lock = (SOURCES.parents[3] / "uv.lock").read_text(encoding="utf-8")
    (low_major, low_minor), (high_major, high_minor) = TESTED
    specifier = f">={low_major}.{low_minor},<{high_major}.{high_minor}"
    assert f'{{ name = "redis", extras = ["hiredis"], specifier = "{specifier}" }}' in lock


def test_every_private_attribute_the_adapter_uses_is_present() -> None:
    verify()


def test_a_missing_attribute_fails_loudly_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    original = ConnectionPool.__init__

    def without_lock(self: ConnectionPool, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]  # passed through as given
        del self._lock

    monkeypatch.setattr(ConnectionPool, "__init__", without_lock)
    with pytest.raises(RedisInternalsError, match=r"ConnectionPool\._lock.*redis >=8\.1,<8\.2"):
        verify()


def test_another_version_fails_loudly_naming_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("importlib.metadata.version", lambda name: "8.2.0")
    with pytest.raises(RedisInternalsError, match=r"redis-py 8\.2\.0 .*redis >=8\.1,<8\.2"):
        verify()


def _uses_redis_py(text: str) -> bool:
    return re.search(r"^(?:from|import) redis\b", text, re.MULTILINE) is not None


def test_no_other_module_names_redis_pys_private_attributes() -> None:
    """Every module that imports redis-py, scanned for the adapter's private names
    (one a module assigns itself, ``self._lock = ...``, is its own; a private name
    of redis-py not listed in the adapter is not caught: review those)."""
    names = sorted({name for group in PRIVATE.values() for name in group})
    found = []
    for path in sorted(SOURCES.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if path.name == "redis_internals.py" or not _uses_redis_py(text):
            continue
        for name in names:
            if re.search(rf"self\.{name}\s*[:=]", text):
                continue
            found += [
                f"{path.name}:{number}: {line.strip()}"
                for number, line in enumerate(text.splitlines(), 1)
                if re.search(rf"(?:\.|def ){name}\b", line)
            ]
    assert found == []
