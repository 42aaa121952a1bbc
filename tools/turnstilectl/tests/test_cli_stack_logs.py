"""The stack's log pump: every line of a service's output, whatever its length.

A service blocks at its next log write once its pipe is full, so a pump that stops
reading stalls the service. A real process writes through a real pipe here.
"""

from __future__ import annotations

import asyncio
import io
import sys

from rich.console import Console

from turnstile_cli.stack.logs import LogPrinter

WRITER = """
import sys
print("before", flush=True)
print("x" * 200_000, flush=True)  # past the reader's 64 KiB line limit
for i in range(2_000):             # more than a pipe holds, after it
    print(f"after {i}", flush=True)
"""


async def test_a_line_past_the_readers_limit_is_dropped_and_the_pump_reads_on() -> None:
    out = io.StringIO()
    printer = LogPrinter(Console(file=out, width=200, color_system=None))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    await asyncio.wait_for(printer.pump("substrate", proc.stdout), 30)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("before")
    assert any("longer than 64 KiB was dropped" in line for line in lines)
    assert lines[-1].endswith("after 1999")
    assert all(len(line) < 1000 for line in lines)
