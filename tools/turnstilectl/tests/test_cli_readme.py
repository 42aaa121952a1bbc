"""The README's Quickstart and certificate snippet, run as written, in a new terminal.

A new user's first hour: from the checkout, in a terminal with nothing set (no
``TURNSTILE_*`` variable, no uv on ``PATH``), every line of the Quickstart's block
and of the local certificate snippet works against a running local stack, and
ends with the exit code its comment promises. The lines are read from README.md
itself, so the test fails when the README changes into something that does not
work.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from turnstile_testing.stack import run_stack

ROOT = Path(__file__).resolve().parents[3]
README = (ROOT / "README.md").read_text()


def _block(after: str) -> list[str]:
    """The commands of the first ```bash block after the heading or text ``after``,
    continuation lines joined."""
    rest = README[README.index(after) :]
    body = re.search(r"```bash\n(.*?)```", rest, re.S)
    assert body is not None, f"no bash block after {after!r}"
    return body.group(1).replace("\\\n", " ").strip().splitlines()


def _new_terminal(state_home: Path) -> dict[str, str]:
    """A new terminal's environment: no TURNSTILE_* or OTEL_* variable, and uv's
    directory (``~/.local/bin``) not on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    local_bin = str(Path.home() / ".local" / "bin")
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p != local_bin
    )
    return {**env, "XDG_STATE_HOME": str(state_home), "COLUMNS": "200"}


def _run(line: str, *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _expected_exit(line: str) -> int:
    """The exit code a Quickstart line's comment promises: ``(exit N)``, else 0."""
    found = re.search(r"\(exit (\d+)\)", line)
    return int(found.group(1)) if found else 0


def test_the_quickstart_has_the_lines_this_test_expects() -> None:
    lines = _block("## Quickstart")
    refused = [line for line in lines if _expected_exit(line) == 3]
    assert refused, "the Quickstart shows a refusal"
    assert all(line.startswith(".venv/bin/turnstilectl activate sb-2") for line in refused)


async def test_the_quickstart_and_the_certificate_snippet_work_as_written(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    # A checkout: its .venv (the workspace's), and the stack's .run/ inside it.
    checkout = tmp_path / "checkout"
    (checkout / ".run").mkdir(parents=True)
    (checkout / ".venv").symlink_to(Path(sys.executable).parent.parent)
    env = _new_terminal(checkout / ".run" / "xdg-state")
    with run_stack(
        checkout / ".run",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
    ) as stack:
        await stack.wait_serving()

        for line in _block("## Quickstart"):
            done = await asyncio.to_thread(_run, line, cwd=checkout, env=env)
            output = f"{line}\n{done.stdout}{done.stderr}"
            assert done.returncode == _expected_exit(line), output
            if _expected_exit(line) == 3:
                # sb-1 runs, charged to acme, now under acme's own key: the cap is full.
                assert "CAP_EXCEEDED" in done.stderr, output
                assert "frees when" in done.stderr, output  # what frees a cap (SPEC P1)

        snippet = _block("**Local stack**")
        for line in snippet:
            done = await asyncio.to_thread(_run, line.strip(), cwd=checkout, env=env)
            assert done.returncode == 0, f"{line}\n{done.stdout}{done.stderr}"
        assert (checkout / ".run" / "tls" / "acme.key").is_file()
        assert stack.interrupt() == 0
