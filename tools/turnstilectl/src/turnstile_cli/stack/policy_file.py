"""The local stack's authorization policy file: the shipped default, kept current
unless the user edited it.

``up`` writes the default policy into the TLS directory on first start and never
overwrites an edited one. A default written by an earlier version is not an
edit, though: left in place it can stop a newer stack from starting (a ``self``
rule without the identity template that SPEC O5 now requires is an invalid
policy). So a file whose SHA-256 is one this or an earlier version wrote (the
marker beside it, or :data:`EARLIER_DEFAULTS`) is replaced by the current
default; an edited file is left alone, but checked, so an invalid one fails the
start with what to do rather than three services refusing to start.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from turnstile_platform.authz.policy import PolicyError, load_policy
from turnstile_platform.redis_client import read_script

#: The SHA-256 of every earlier version of ``authz-policy.toml`` (its git history), for
#: files written before the marker existed; a test keeps it whole when the default changes.
EARLIER_DEFAULTS = frozenset(
    {
        "00f47162e9849d8fb7e6af189d29c92d1d25fc2a4aa44beaf787d99f60114ff4",
        "094ccfb61735b167ec441c242ab8e11a6783b6881855ddd828d1ac035b71b83c",
        "1985224d9f9f029a8e1aaa6dd48ad0a065b8a6339fb60e0ec9a21fcff8119481",
        "24f094eb52730aaaad6d0cfef7e7d5069b1ca9a86ed819dacfa55edfdc2b4885",
        "670ade2ede5bb01b28cf7635c31f876caccdd3193762de641df35c2b2d26bd10",
        "7b2782bcf9f7e1a43a56a577230b146e69ae579d9a5c3cfff65dfba8b127a04b",
        "80d63ae6345dd58af891e53e7154333eeba16516f68abdc2d72badc2f08a20ab",
        "92de65e202d32f5332c3fe79ea0a6caff301ed93281619f0520f38a6239aad41",
        "97c3e3e18ca6b204f17dc7f137d947ee6aacff6a48bb41e3c71c2120f371bcbf",
        "9c7e1d7c7a20d3aebda7f3fddf3bcd71cf7c94c133de4bc58c98c2074f669069",
        "de85ae7c0fc89129eec80a71fe453f252252e889c7c466efa6cf1cd55a37fa57",
        "f57f9ec3015fef0fe5d30ad926e2eeca1a8cb2e97c3ea2679fea74566343c5b9",
    }
)

FILE_NAME = "policy.toml"
MARKER_NAME = "policy.toml.sha256"


class PolicyFileError(ValueError):
    """The edited policy file is not valid for this version; the message says what to do."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ensure_policy(tls_dir: Path) -> str | None:
    """Make ``tls_dir/policy.toml`` the current default unless it was edited; what
    was done, for the runner to say (None: nothing worth saying)."""
    shipped = read_script("turnstile_cli.stack", "authz-policy.toml").encode()
    path, marker = tls_dir / FILE_NAME, tls_dir / MARKER_NAME
    note = None
    if path.exists():
        current = path.read_bytes()
        if current == shipped:
            _write(marker, _sha256(shipped).encode())
            return None
        written = marker.read_text().strip() if marker.exists() else ""
        if _sha256(current) not in EARLIER_DEFAULTS | {written}:
            _check(path)
            return f"{path} was edited: kept as it is (delete it to get this version's default)"
        note = f"{path}: an earlier version's default, replaced by this version's"
    _write(path, shipped)
    _write(marker, _sha256(shipped).encode())
    return note


def _check(path: Path) -> None:
    try:
        load_policy(path)
    except PolicyError as error:
        raise PolicyFileError(
            f"{path} (edited) is not a valid policy for this version: {error}. Fix it, or "
            "delete it and the stack writes this version's default"
        ) from None


def _write(path: Path, data: bytes) -> None:
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_bytes(data)
    partial.replace(path)
