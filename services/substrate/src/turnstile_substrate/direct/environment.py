"""The environment a Direct runtime starts with: an allowlist, never the substrate's own (SPEC O4).

The substrate's environment holds its secrets (``TURNSTILE_DATABASE_URL``,
``PGPASSWORD``, cloud credentials such as ``AWS_SECRET_ACCESS_KEY``, whatever the
operator's shell exported), and a runtime runs untrusted code. So a runtime's
environment is built, not filtered: from the substrate's environment only

- the names in :data:`BASE_ALLOWLIST` (and any ``LC_*``): what a process needs to
  find commands and speak the host's locale and time zone;
- ``TURNSTILE_LOG_LEVEL`` and ``TURNSTILE_LOG_FORMAT``, which the worker agent reads;
- the names an operator adds with ``TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW`` (exact
  names, none by default: adding one is a decision to hand its value to untrusted
  code);

and then what the substrate sets itself: ``HOME`` (the runtime's own workspace,
never the substrate's home) and the worker agent's settings (sandbox id, tier,
capacity, relay address, credential file, the sandbox-class TLS files).

The same base (without the per-runtime settings) is the environment of the
preloaded launcher, because a forked runtime inherits the launcher's
``/proc/<pid>/environ`` whatever it later sets in ``os.environ``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from turnstile_platform.settings import SettingsError

#: Names passed from the substrate's environment when set there (plus ``LC_*``).
BASE_ALLOWLIST = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM"})

#: The substrate's ``TURNSTILE_*`` settings the worker agent reads as well.
PASSED_SETTINGS = frozenset({"TURNSTILE_LOG_LEVEL", "TURNSTILE_LOG_FORMAT"})

#: An environment variable's name, as ``TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW`` lists them.
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_names(value: str) -> frozenset[str]:
    """The comma-separated names of ``TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW``.

    Raises ValueError naming the first entry that is not a variable name (no
    patterns: a wildcard would pass secrets nobody named).
    """
    names = [name.strip() for name in value.split(",") if name.strip()]
    for name in names:
        if not NAME.fullmatch(name):
            raise SettingsError(
                f"TURNSTILE_DIRECT_RUNTIME_ENV_ALLOW: {name!r} is not an environment variable name"
            )
    return frozenset(names)


def allowed(name: str, extra: Collection[str]) -> bool:
    """Whether the substrate's variable ``name`` may reach a runtime."""
    return (
        name in BASE_ALLOWLIST or name.startswith("LC_") or name in PASSED_SETTINGS or name in extra
    )


def base_environment(source: Mapping[str, str], extra: Collection[str]) -> dict[str, str]:
    """The allowed part of ``source`` (the substrate's environment)."""
    return {name: value for name, value in source.items() if allowed(name, extra)}


def runtime_environment(
    source: Mapping[str, str],
    extra: Collection[str],
    home: str,
    settings: Mapping[str, str],
) -> dict[str, str]:
    """A runtime's whole environment: the allowed part of ``source``, ``HOME``, and
    the worker settings the substrate gives it (which win over anything passed)."""
    env = base_environment(source, extra)
    env["HOME"] = home
    env.update(settings)
    return env
