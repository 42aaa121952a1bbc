"""Service logs, prefixed and coloured, interleaved on one terminal."""

from __future__ import annotations

import asyncio

from rich.console import Console
from rich.text import Text

STYLES = {
    "admission": "cyan",
    "substrate": "magenta",
    "affinity": "green",
    "migrate": "blue",
    "stack": "bold white",
}
_WIDTH = max(len(name) for name in STYLES)


class LogPrinter:
    def __init__(self, console: Console) -> None:
        self.console = console

    def line(self, source: str, text: str) -> None:
        style = ""
        if " ERROR " in text or "Traceback" in text:
            style = "red"
        elif " WARNING " in text:
            style = "yellow"
        prefix = Text(f"{source:<{_WIDTH}} │ ", style=STYLES.get(source, "white"))
        self.console.print(prefix + Text(text, style=style), soft_wrap=True, highlight=False)

    async def pump(self, source: str, stream: asyncio.StreamReader) -> None:
        """Print every line of ``stream`` until it closes.

        A line longer than the reader's limit (64 KiB) is dropped with a note, and
        the pump goes on: if it stopped, nobody would drain the service's pipe, and
        the service would block at its next log write and serve nothing more."""
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # readline has discarded what it buffered of the line
                self.line(source, "(a log line longer than 64 KiB was dropped here)")
                continue
            if not raw:
                return
            self.line(source, raw.decode(errors="replace").rstrip())
