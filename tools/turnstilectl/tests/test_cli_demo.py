"""The demo, end to end, against a stack of real processes started by the test."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from turnstile_testing.stack import run_stack


# About 35 s (a whole stack, nine steps, a grace period): in the default run, because
# "the demo runs to its end" is what a new user is promised.
@pytest.mark.timeout(120)
async def test_demo_tells_the_whole_story_and_prints_a_trace_id_per_step(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        grace_s=2.0,
    ) as stack:
        await stack.wait_serving()
        human = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "turnstile_cli", "demo", "--color", "never", "--max-wait", "40"],
            env=stack.env(),
            capture_output=True,
            text=True,
            timeout=50,
            check=False,
        )
        assert human.returncode == 0, human.stdout + human.stderr
        out = human.stdout
        for beat in (
            "1/9",
            "floods a contended cluster",  # the fair queue (SPEC Q1) ...
            "s in the fair queue; queue position 1 when it joined, estimated",
            "✗ refused",  # the in-flight cap
            "RATE_LIMITED",
            "(first)",
            "(hit)",
            "SANDBOX_PENDING",
            "(fallback)",
            "may not act for sandbox",  # a tenant refused another's sandbox
            "the same PERMISSION_DENIED for both",  # ... and a missing one, alike
            "turnstilectl why",  # the story ends asking why the rate limiter refused
            "refused by the rate limit of key acme-",
            "The end.",
        ):
            # Lines wrap at the terminal's width: compare with the whitespace folded.
            assert " ".join(beat.split()) in " ".join(out.split()), f"{beat!r} missing from:\n{out}"
        # The reset is the first thing printed for the fallback turn.
        fallback_turn = out.rsplit("$ turnstilectl place", 1)[1]
        assert fallback_turn.splitlines()[1].lstrip().startswith("WARNING")

        summary = out.split("Traces of each step", 1)[1]
        trace_ids = re.findall(r"^\s+([0-9a-f]{32})\s+\d\. ", summary, flags=re.MULTILINE)
        assert len(set(trace_ids)) == 9, summary
        assert await asyncio.to_thread(stack.interrupt) == 0, stack.output()
