"""The local stack's policy file: the current default unless edited, and an edited
one checked before the services see it."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from turnstile_cli.stack.policy_file import (
    EARLIER_DEFAULTS,
    MARKER_NAME,
    PolicyFileError,
    ensure_policy,
)
from turnstile_platform.authz.policy import load_policy
from turnstile_platform.redis_client import read_script

SHIPPED = read_script("turnstile_cli.stack", "authz-policy.toml")
REPO = Path(__file__).resolve().parents[3]
SHIPPED_PATH = "tools/turnstilectl/src/turnstile_cli/stack/authz-policy.toml"


def test_a_missing_policy_is_written_with_its_marker(tmp_path: Path) -> None:
    assert ensure_policy(tmp_path) is None
    assert (tmp_path / "policy.toml").read_text() == SHIPPED
    assert (tmp_path / MARKER_NAME).read_text() == hashlib.sha256(SHIPPED.encode()).hexdigest()
    load_policy(tmp_path / "policy.toml")


def test_a_default_this_stack_wrote_earlier_is_replaced_by_the_current_one(
    tmp_path: Path,
) -> None:
    old = "# an earlier default\n[[allow]]\nidentities = ['*']\nmethods = ['*']\n"
    (tmp_path / "policy.toml").write_text(old)
    (tmp_path / MARKER_NAME).write_text(hashlib.sha256(old.encode()).hexdigest())
    note = ensure_policy(tmp_path)
    assert note is not None
    assert "replaced" in note
    assert (tmp_path / "policy.toml").read_text() == SHIPPED


def test_an_edited_policy_is_kept_and_said_so(tmp_path: Path) -> None:
    edited = SHIPPED + "\n# my change\n"
    (tmp_path / "policy.toml").write_text(edited)
    note = ensure_policy(tmp_path)
    assert note is not None
    assert "edited" in note
    assert (tmp_path / "policy.toml").read_text() == edited


def test_an_edited_policy_invalid_for_this_version_fails_with_what_to_do(tmp_path: Path) -> None:
    # A self rule without the identity template: valid before SPEC O5, not now.
    edited = '[[allow]]\nidentities = ["spiffe://turnstile.local/client/*"]\n'
    edited += 'methods = ["turnstile.substrate.v1.SubstrateService/Activate"]\nclients = "self"\n'
    (tmp_path / "policy.toml").write_text(edited)
    with pytest.raises(PolicyFileError, match="delete it"):
        ensure_policy(tmp_path)
    assert (tmp_path / "policy.toml").read_text() == edited


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout"
)
def test_the_earlier_defaults_are_the_shipped_policys_history() -> None:
    log = subprocess.run(
        ["git", "log", "--format=%H", "--", SHIPPED_PATH],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    history = set()
    for commit in log.stdout.split():
        shown = subprocess.run(
            ["git", "show", f"{commit}:{SHIPPED_PATH}"], cwd=REPO, capture_output=True, check=True
        )
        history.add(hashlib.sha256(shown.stdout).hexdigest())
    current = hashlib.sha256(SHIPPED.encode()).hexdigest()
    # Every earlier default is recognised (the current one is recognised by content).
    assert history - {current} <= EARLIER_DEFAULTS
