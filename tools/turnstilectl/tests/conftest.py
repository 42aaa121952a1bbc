"""Every CLI test reads and writes the per-user stack description under its own
directory: a developer's running stack (``~/.local/state/turnstile``) is never
taken for the test's, nor the test's for theirs."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _own_state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
