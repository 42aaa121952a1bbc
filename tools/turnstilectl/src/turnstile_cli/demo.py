"""``demo``: placeholder until the demo lands."""

from __future__ import annotations

from turnstile_cli.commands.base import Subparsers


def register(sub: Subparsers) -> None:
    return None
