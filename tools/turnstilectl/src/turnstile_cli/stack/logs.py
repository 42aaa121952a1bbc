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
        """Print every line of ``stream`` until it closes."""
        while True:
            raw = await stream.readline()
            if not raw:
                return
            self.line(source, raw.decode(errors="replace").rstrip())
