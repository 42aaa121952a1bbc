"""Entry point of ``turnstilectl``."""

from __future__ import annotations

import sys

from turnstile_cli.cli import run


def main() -> None:
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":
    main()
