"""Process entry points: logging, the event loop, and the service bootstrap."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from turnstile_platform.logs import configure_logging
from turnstile_platform.settings import ServiceSettings


def run_service(
    name: str,
    settings: ServiceSettings,
    main: Callable[[ServiceSettings], Coroutine[Any, Any, None]],
) -> None:
    """Configure logs, then run ``main(settings)`` on uvloop until it returns."""
    configure_logging(name, level=settings.log_level, fmt=settings.log_format)
    uvloop.run(main(settings))
