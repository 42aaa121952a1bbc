"""Who the local stack's sandbox runtimes run as (SPEC O4)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from turnstile_cli.stack.runtime_user import (
    RUNTIME_UIDS,
    probe,
    runnable_interpreter,
    runtime_user_env,
    unreachable_parent,
)

FIRST_UID = int(RUNTIME_UIDS.split("-")[0])

AS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="the stack picks runtime uids as root only")


def test_a_runtime_user_you_set_wins(tmp_path: Path) -> None:
    environ = {"TURNSTILE_DIRECT_RUNTIME_USER": "nobody"}
    assert runtime_user_env(tmp_path / "direct", environ) == ({}, None)


@AS_ROOT
def test_a_state_dir_other_uids_cannot_reach_runs_runtimes_as_root_and_says_why(
    tmp_path: Path,
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    env, note = runtime_user_env(private / "direct", {})
    assert env == {"TURNSTILE_DIRECT_RUNTIME_USER": "root"}
    assert note is not None
    assert "ROOT" in note
    assert str(private) in note or str(tmp_path) in note
    assert "use a checkout (or --state-dir) outside it" in note


@AS_ROOT
def test_as_root_runtimes_get_a_uid_each_when_such_a_uid_can_run_the_worker() -> None:
    state_dir = Path("/tmp") / "turnstile-stack-probe" / "direct"
    env, note = runtime_user_env(state_dir, {})
    reason = probe(int(RUNTIME_UIDS.split("-")[0]))
    if reason is None:
        assert env == {"TURNSTILE_DIRECT_RUNTIME_UIDS": RUNTIME_UIDS}
    else:  # this interpreter is root's alone (a pyenv under /root, say)
        assert env == {"TURNSTILE_DIRECT_RUNTIME_USER": "root"}
        assert note is not None
        assert reason in note


@AS_ROOT
def test_falling_back_to_root_names_an_interpreter_a_runtime_uid_can_run() -> None:
    """The root-runtime note is a fix, not a list of variables: the command it gives
    rebuilds the workspace on an interpreter the runtimes' uids can in fact run."""
    if probe(FIRST_UID) is None:
        pytest.skip("this workspace's interpreter is runnable by other uids already")
    _, note = runtime_user_env(Path("/tmp") / "turnstile-stack-probe" / "direct", {})
    assert note is not None
    hidden = unreachable_parent(Path(sys.prefix))
    suggested = re.search(r"UV_PYTHON=(/\S+) \./scripts/up", note)
    if hidden is not None:  # the workspace itself is out of their reach: move it
        assert f"the workspace is under {hidden}" in note
        assert "use a checkout (or --state-dir) outside it" in note
    elif suggested is None:  # no interpreter here other users can run: uv's managed one
        assert "UV_PYTHON_INSTALL_DIR=" in note
        assert "uv python install" in note
    else:
        assert runnable_interpreter(FIRST_UID, (suggested.group(1),)) == suggested.group(1)
    assert "docs/substrate.md" in note


@AS_ROOT
def test_an_interpreter_only_root_can_run_is_not_suggested() -> None:
    if probe(FIRST_UID) is None:
        pytest.skip("this workspace's interpreter is runnable by other uids already")
    assert runnable_interpreter(FIRST_UID, (sys.executable,)) is None
