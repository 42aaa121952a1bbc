"""Process entry points: logging, the event loop, and the service bootstrap."""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop

from turnstile_platform.authz.policy import PolicyError
from turnstile_platform.logs import configure_logging
from turnstile_platform.settings import ServiceSettings, SettingsError
from turnstile_platform.tls import TransportSecurityError

log = logging.getLogger(__name__)

#: Exit status of a process that refused to start on unsafe or missing security settings.
EXIT_MISCONFIGURED = 2


def run_service(
    name: str,
    settings: ServiceSettings,
    main: Callable[[ServiceSettings], Coroutine[Any, Any, None]],
) -> None:
    """Configure logs, then run ``main(settings)`` on uvloop until it returns.

    Missing certificates, plaintext off loopback, an invalid policy file or settings
    the service cannot start with (:class:`SettingsError`) end the process with one
    log line saying what to set (exit status 2), not a traceback.
    """
    configure_logging(name, level=settings.log_level, fmt=settings.log_format)
    try:
        uvloop.run(main(settings))
    except (TransportSecurityError, PolicyError, SettingsError) as error:
        log.error("refusing to start: %s", error)
        raise SystemExit(EXIT_MISCONFIGURED) from None
