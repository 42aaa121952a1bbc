"""Which keys each Lua script declared, and which it touched: read from Redis's own
``MONITOR`` stream, so a test checks what the server ran, not what the code says.

Redis writes a script's ``EVALSHA`` line to ``MONITOR`` and, one line each, every
command the script ran (marked ``[<db> lua]``); a script is atomic, so its lines
are never interleaved with another client's. Whether the ``EVALSHA`` line comes
before its commands (Redis 7.0) or after them is found per node by a calibration
script run first. ``COMMAND GETKEYS`` names the keys of each command, so no key
position is hard-coded here.

A Redis Cluster checks only that a script's keys share a slot; a key it touched
without declaring it, in the same slot, goes unnoticed there (and is refused by
proxies and servers that check declarations). This recorder sees both.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.client import Monitor
from redis.exceptions import ResponseError

from turnstile_platform.background import BackgroundTasks

_LINE = re.compile(r"^\S+ \[\d+ (?P<client>[^\]]+)\] (?P<args>.*)$")
_ARG = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|.)")
_SIMPLE = {"n": "\n", "r": "\r", "t": "\t", "a": "\a", "b": "\b"}


def _unescape(text: str) -> str:
    """Undo the quoting Redis applies to MONITOR arguments (``sdscatrepr``)."""

    def one(match: re.Match[str]) -> str:
        code = match.group(1)
        if code.startswith("x") and len(code) == 3:
            return chr(int(code[1:], 16))
        return _SIMPLE.get(code, code)

    return _ESCAPE.sub(one, text)


def parse_line(line: str) -> tuple[str, list[str]] | None:
    """``(client, arguments)`` of one MONITOR line; client is ``lua`` inside a script."""
    match = _LINE.match(line)
    if match is None:
        return None
    return match["client"], [_unescape(a) for a in _ARG.findall(match["args"])]


def sha1(script: str) -> str:
    return hashlib.sha1(
        script.encode(), usedforsecurity=False
    ).hexdigest()  # as Redis names scripts


@dataclass
class ScriptRun:
    """One EVALSHA/EVAL as the server ran it."""

    script: str
    """The name the recorder was given for the script's SHA (or the SHA itself)."""
    declared: list[str]
    commands: list[list[str]] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)

    def undeclared(self) -> set[str]:
        return self.touched - set(self.declared)


class ScriptKeyRecorder:
    """MONITOR on each of ``nodes`` (every master of a cluster, or one server) while
    a test runs scripts; :meth:`runs` then says what each run declared and touched.

    ``names`` maps each script's full text to a name for the report. Only runs
    whose declared keys start with ``prefix`` are kept (a shared server has other
    clients)."""

    def __init__(self, nodes: Sequence[aioredis.Redis], names: dict[str, str], prefix: str) -> None:
        self._nodes = list(nodes)
        self._names = {sha1(text): name for text, name in names.items()}
        self._prefix = prefix
        self._lines: list[list[str]] = [[] for _ in self._nodes]
        self._monitors: list[Monitor] = []
        self._readers = BackgroundTasks("script key recorder")
        self._arrived = asyncio.Condition()

    async def __aenter__(self) -> ScriptKeyRecorder:
        for n, node in enumerate(self._nodes):
            monitor = node.monitor()
            await monitor.__aenter__()
            self._monitors.append(monitor)
            self._readers.spawn(self._read(monitor, self._lines[n]), name=f"monitor {n}")
        self._calibration = f"return redis.call('TIME') -- script-keys {uuid.uuid4().hex}"
        for node in self._nodes:  # no keys: every node runs it itself
            await node.eval(self._calibration, 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._readers.close()
        for monitor in self._monitors:
            await monitor.__aexit__(None, None, None)

    async def _read(self, monitor: Monitor, into: list[str]) -> None:
        assert monitor.connection is not None
        while True:
            raw = await monitor.connection.read_response()
            async with self._arrived:
                into.append(
                    raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
                )
                self._arrived.notify_all()

    async def _flush(self) -> None:
        """Wait until every node's stream has caught up with everything sent so far."""
        marker = f"script-keys-flush-{uuid.uuid4().hex}"
        for node in self._nodes:
            await node.echo(marker)
        async with self._arrived:
            await self._arrived.wait_for(
                lambda: all(any(marker in line for line in lines) for lines in self._lines)
            )

    async def runs(self) -> list[ScriptRun]:
        """Every script run so far with a declared key under the prefix."""
        await self._flush()
        found: list[ScriptRun] = []
        for lines in self._lines:
            parsed = [p for p in map(parse_line, lines) if p is not None]
            calibration = next(i for i, (_, args) in enumerate(parsed) if self._calibration in args)
            # Its one command, TIME, is logged right before or right after it.
            time = ("lua", ["TIME"])
            before = calibration > 0 and parsed[calibration - 1] == time
            after = calibration + 1 < len(parsed) and parsed[calibration + 1] == time
            calls_first = before and not after
            found += group_runs(
                parsed, names=self._names, prefix=self._prefix, calls_first=calls_first
            )
        for run in found:
            run.touched = await _keys_of(self._nodes[0], run.commands)
        return found


def group_runs(
    parsed: list[tuple[str, list[str]]], *, names: dict[str, str], prefix: str, calls_first: bool
) -> list[ScriptRun]:
    """Each script run in one node's parsed MONITOR lines, with its commands: logged
    after its EVALSHA line, or before it when ``calls_first``. ``names``: SHA → name."""
    found: list[ScriptRun] = []
    block: list[list[str]] = []  # lua lines not yet given to their script
    current: ScriptRun | None = None
    for client, args in parsed:
        if client == "lua":
            (block if calls_first else current.commands if current else []).append(args)
            continue
        current = None
        if args and args[0].lower() in ("evalsha", "eval", "evalsha_ro", "eval_ro"):
            keys = args[3 : 3 + int(args[2])]
            if keys and all(key.startswith(prefix) for key in keys):
                script = args[1] if args[0].lower().startswith("evalsha") else sha1(args[1])
                current = ScriptRun(names.get(script, script), keys)
                found.append(current)
                if calls_first:
                    current.commands = block
        block = []
    return found


async def _keys_of(node: aioredis.Redis, commands: Iterable[list[str]]) -> set[str]:
    """The keys of ``commands``, as the server's own key specs find them."""
    keys: set[str] = set()
    for command in commands:
        try:
            found = await node.command_getkeys(*command)
        except ResponseError:  # a command without keys (TIME)
            continue
        keys.update(k.decode() if isinstance(k, bytes) else str(k) for k in found)
    return keys
