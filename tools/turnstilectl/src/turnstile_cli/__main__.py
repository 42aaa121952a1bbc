"""Entry point of ``turnstilectl``."""

from __future__ import annotations

import sys


def main() -> None:
    print("turnstilectl: commands land with the CLI issue", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
