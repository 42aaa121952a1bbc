"""The local PKI's files are private where they must be (SPEC O4): every key is 0600
in a 0700 directory, owned by whoever runs the stack; certificates are public."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from turnstile_platform.pki import ensure_local_pki

HOLDERS = {"substrate": "service/substrate", "worker": "sandbox"}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_the_owners_alone_and_certificates_are_public(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    ensure_local_pki(directory, "turnstile.local", HOLDERS)
    assert _mode(directory) == 0o700
    for key in ("ca.key", "substrate.key", "worker.key"):
        assert _mode(directory / key) == 0o600, key
        assert (directory / key).stat().st_uid == os.geteuid()
    for cert in ("ca.crt", "substrate.crt", "worker.crt"):
        assert _mode(directory / cert) == 0o644, cert


def test_a_temporary_file_left_by_a_crash_does_not_make_a_key_readable(tmp_path: Path) -> None:
    directory = tmp_path / "tls"
    directory.mkdir()
    stale = directory / ".substrate.key.tmp"
    stale.write_bytes(b"half a key")
    os.chmod(stale, 0o644)
    ensure_local_pki(directory, "turnstile.local", HOLDERS)
    assert _mode(directory / "substrate.key") == 0o600
