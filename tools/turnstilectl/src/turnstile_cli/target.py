"""Which stack a command acts on, chosen explicitly and named (SPEC M2).

A command's target comes from, in order: ``--stack`` (a checkout, or a
``stack.json``), then the environment (``TURNSTILE_STACK``, or the older
``TURNSTILE_STACK_FILE``), then service addresses given by flag or
``TURNSTILE_*_ADDR`` (the stack holding them is named when one does), then the
checkout the command runs in: the working directory's (the nearest directory
holding ``.run/`` or ``scripts/up``), else the one whose ``.venv`` the
``turnstilectl`` console script belongs to. Another checkout's stack is never
used for it: a checkout whose stack is not running gets "no stack running for
<checkout>" (exit 4), and outside any checkout with nothing given the command
lists the running stacks and how to choose one (exit 2), as kubectl acts on an
explicit context and says which.

The user's ``$XDG_STATE_HOME/turnstile`` registry (``stacks/<pid>.json``,
written by ``turnstilectl up``) is only read to name and list stacks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from turnstile_cli.exits import Exit
from turnstile_cli.stack import state

if TYPE_CHECKING:
    import argparse

    from turnstile_cli.context import LocalStack

SERVICES = ("admission", "substrate", "affinity")

#: The variables that name a stack: a checkout or a ``stack.json``.
STACK_VARIABLES = ("TURNSTILE_STACK", "TURNSTILE_STACK_FILE")

#: What a stopped stack's user is told to run (from its checkout).
START_HINT = "start it with ./scripts/up"


class TargetError(Exception):
    """No stack can be acted on: ``text`` says why and what to do; ``stacks``
    are the running ones (for ``--json``)."""

    def __init__(
        self, text: str, *, reason: str, exit_code: Exit, stacks: list[LocalStack] | None = None
    ) -> None:
        super().__init__(text)
        self.reason = reason
        self.exit_code = exit_code
        self.stacks = stacks or []


@dataclass(frozen=True)
class Target:
    """What a command acts on and how it was chosen."""

    #: How it was chosen: ``--stack``, ``TURNSTILE_STACK``, ``--admission``,
    #: ``TURNSTILE_ADMISSION_ADDR``, ``this checkout`` …
    chosen_by: str
    #: The checkout the stack belongs to (None: addresses of no known stack).
    checkout: Path | None = None
    #: The running stack (its description), when the target is one.
    stack: LocalStack | None = None
    #: Addresses given explicitly (flags or variables), by service.
    addresses: dict[str, str] | None = None

    def describe(self) -> str:
        """The target in one line: ``the stack of /src/a (this checkout) at
        127.0.0.1:50051/50052/50053, mutual TLS``."""
        shown = {**(self.stack.addresses if self.stack else {}), **(self.addresses or {})}
        where = _addresses([shown[name] for name in SERVICES if name in shown])
        if self.stack is None:
            return f"{where or 'the services'} ({self.chosen_by})"
        owner = (
            f"the stack of {self.checkout}" if self.checkout else f"the stack in {self.stack.path}"
        )
        return f"{owner} ({self.chosen_by}) at {where}, {self.stack.mode}"

    def as_dict(self) -> dict[str, object]:
        return {
            "chosen_by": self.chosen_by,
            "checkout": str(self.checkout) if self.checkout else None,
            "stack_file": str(self.stack.path) if self.stack else None,
            "running": self.stack is not None,
            "addresses": dict(self.stack.addresses) if self.stack else dict(self.addresses or {}),
        }


def is_checkout(directory: Path) -> bool:
    """Whether ``directory`` is a Turnstile checkout (or a stack's home): it holds
    ``.run/`` (written by ``up``) or ``scripts/up``."""
    return (directory / ".run").is_dir() or (directory / "scripts" / "up").is_file()


def checkout_here() -> tuple[Path, str] | None:
    """The checkout this command runs in and how it was found: the working
    directory's (it or a parent), else the one whose ``.venv/bin/turnstilectl``
    runs (``/src/a/.venv/bin/turnstilectl status`` from ``/tmp`` is ``/src/a``'s)."""
    here = Path.cwd()
    for directory in (here, *here.parents):
        if is_checkout(directory):
            return directory, "this checkout"
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.name == "turnstilectl":
        venv = script.absolute().parent.parent
        if venv.name == ".venv" and is_checkout(venv.parent):
            return venv.parent, f"the checkout of {script}"
    return None


def checkout_of(path: Path, description: dict[str, object] | None = None) -> Path | None:
    """The checkout a ``stack.json`` belongs to: the parent of the ``.run/`` it
    lies in, or of the ``.run/`` its state directory lies in (None: neither)."""
    path = path.absolute()
    if path.parent.name == ".run":
        return path.parent.parent
    state_dir = (description or {}).get("state_dir")
    if isinstance(state_dir, str) and Path(state_dir).parent.name == ".run":
        return Path(state_dir).parent.parent
    return None


def running_stacks() -> list[LocalStack]:
    """Every stack the user's registry knows that still runs, newest first."""
    from turnstile_cli.context import LocalStack

    home = state.user_file().parent
    entries = [e for e in home.glob("stacks/*.json") if e.is_file()]
    entries.sort(key=lambda e: e.stat().st_mtime, reverse=True)
    found: dict[object, LocalStack] = {}
    for entry in [*entries, state.user_file()]:
        stack = LocalStack.read(entry)
        if stack is not None and stack.pid not in found:
            found[stack.pid] = stack
    return list(found.values())


def stack_of_checkout(checkout: Path) -> LocalStack | None:
    """The running stack of ``checkout``: its ``.run/stack.json``, or a registered
    stack whose state lies in its ``.run/``."""
    from turnstile_cli.context import LocalStack

    own = LocalStack.read(checkout / ".run" / state.FILE_NAME)
    if own is not None:
        return own
    for stack in running_stacks():
        if stack.checkout is not None and stack.checkout == checkout.absolute():
            return stack
    return None


def _not_running(checkout: Path | str) -> TargetError:
    others = [s for s in running_stacks() if s.checkout is None or str(s.checkout) != str(checkout)]
    text = f"no stack running for {checkout}; {START_HINT}"
    if others:
        text += " (running: " + "; ".join(_choice(s) for s in others) + ")"
    return TargetError(text, reason="STACK_NOT_RUNNING", exit_code=Exit.RETRYABLE, stacks=others)


def _choice(stack: LocalStack) -> str:
    return f"--stack {stack.checkout or stack.path}"


def _named_stack(text: str, chosen_by: str) -> Target:
    from turnstile_cli.context import LocalStack

    path = Path(text).expanduser().absolute()
    file = path if path.suffix == ".json" or path.is_file() else path / ".run" / state.FILE_NAME
    checkout = checkout_of(file) or (path if file != path else None)
    stack = LocalStack.read(file)
    if stack is None:
        raise _not_running(checkout or file)
    return Target(chosen_by=chosen_by, checkout=stack.checkout or checkout, stack=stack)


def resolve(args: argparse.Namespace, *, redis_explicit: bool = False) -> Target:
    """The command's target (:class:`TargetError` when there is none to act on).

    Flags before variables: ``--stack``, then address flags, then
    ``TURNSTILE_STACK`` (``_FILE``), then ``TURNSTILE_*_ADDR``, then the checkout.
    ``redis_explicit``: the command acts on Redis and was given its prefix
    (``keys``, ``limits``), which names what it changes without a stack."""
    env = os.environ
    named = getattr(args, "stack", None)
    if named:
        return _named_stack(named, "--stack")
    found = checkout_here()
    flags = _given(args, from_env=False)
    if flags:
        return _addressed(flags, found)
    for variable in STACK_VARIABLES:
        if env.get(variable):
            return _named_stack(env[variable], variable)
    variables = _given(args, from_env=True)
    if variables:
        return _addressed(variables, found)
    if found is not None:
        checkout, how = found
        stack = stack_of_checkout(checkout)
        if stack is None:
            if redis_explicit:
                return Target(chosen_by=f"{how}, its Redis prefix", checkout=checkout)
            raise _not_running(checkout)
        return Target(chosen_by=how, checkout=checkout, stack=stack)
    if redis_explicit:
        return Target(chosen_by="the Redis prefix given")
    stacks = running_stacks()
    if not stacks:
        raise TargetError(
            "no stack running, and this directory is in no checkout: run ./scripts/up in "
            "a checkout, or name the services (--admission/--substrate/--affinity or "
            "TURNSTILE_*_ADDR)",
            reason="STACK_NOT_RUNNING",
            exit_code=Exit.RETRYABLE,
        )
    listed = "; ".join(f"{s.checkout or s.path} ({_address(s)})" for s in stacks)
    first = stacks[0].checkout or stacks[0].path
    raise TargetError(
        f"this directory is in no checkout and nothing names a stack; running: {listed}. "
        f"Choose one with --stack {first} or TURNSTILE_STACK={first}, "
        "or run the command in its checkout",
        reason="NO_TARGET",
        exit_code=Exit.USAGE,
        stacks=stacks,
    )


def _address(stack: LocalStack) -> str:
    return stack.addresses.get("admission", "?")


def _addresses(addresses: list[str]) -> str:
    """``127.0.0.1:50051/50052/50053`` when they share a host, else each in full."""
    hosts = {a.rsplit(":", 1)[0] for a in addresses}
    if len(hosts) == 1 and all(":" in a for a in addresses):
        (host,) = hosts
        return host + ":" + "/".join(a.rsplit(":", 1)[1] for a in addresses)
    return ", ".join(addresses)


def _given(args: argparse.Namespace, *, from_env: bool) -> dict[str, tuple[str, str]]:
    """Addresses given by flag (``--target``, ``--admission`` …) or by variable
    (``TURNSTILE_ADMISSION_ADDR`` …): service → (address, what gave it)."""
    given: dict[str, tuple[str, str]] = {}
    for name in SERVICES:
        if from_env:
            variable = f"TURNSTILE_{name.upper()}_ADDR"
            if os.environ.get(variable):
                given[name] = (os.environ[variable], variable)
        elif getattr(args, "service", None) == name and getattr(args, "target", None):
            given[name] = (args.target, "--target")
        elif getattr(args, name, None):
            given[name] = (getattr(args, name), f"--{name}")
    return given


def _addressed(given: dict[str, tuple[str, str]], found: tuple[Path, str] | None) -> Target:
    """Addresses given: the target is them, and the stack that listens there when
    one does (its transport applies, and it is named)."""
    addresses = {name: address for name, (address, _) in given.items()}
    candidates = running_stacks()
    if found is not None:
        own = stack_of_checkout(found[0])
        candidates = [*([own] if own is not None else []), *candidates]
    holder = next(
        (s for s in candidates if set(addresses.values()) <= set(s.addresses.values())), None
    )
    return Target(
        chosen_by=", ".join(dict.fromkeys(how for _, how in given.values())),
        checkout=holder.checkout if holder else None,
        stack=holder,
        addresses=addresses,
    )
