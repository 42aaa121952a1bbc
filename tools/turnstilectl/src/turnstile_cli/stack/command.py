"""``up``: placeholder until the stack runner lands."""

from __future__ import annotations

from turnstile_cli.commands.base import Subparsers


def register(sub: Subparsers) -> None:
    return None
