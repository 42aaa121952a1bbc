"""Where a command's answer goes: rich tables for people, JSON for scripts.

Every command builds one JSON-able payload and, for people, a renderer. In
``--json`` mode (``-o json``) only the payload is printed (one object on stdout,
errors too, so a script reads one stream and the exit code); ``-o yaml`` prints
the same payload as YAML, ``-o name`` only the ids it names (one a line, errors
on stderr); otherwise the renderer draws on a rich console (``-o wide``: never
cut to the terminal's width). Warnings a person must not miss (a workspace
reset) are printed before anything else.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any, cast

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from google.protobuf import message
    from google.protobuf.timestamp_pb2 import Timestamp

    from turnstile_client import TurnstileError
    from turnstile_contracts import admission_pb2, substrate_pb2

#: Width of output that is not a terminal (a pipe, a file): rich would cut tables
#: at 80 columns; ``COLUMNS`` still wins when set.
PIPED_WIDTH = 200

#: Width of ``-o wide`` output: as wide as the content, whatever the terminal.
WIDE_WIDTH = 10_000

Renderer = Callable[[Console], None]

#: The fields that name what a payload shows, in the order ``-o name`` looks.
NAME_FIELDS = ("session_id", "sandbox_id", "hold_id", "client_id", "key")


def names(payload: Mapping[str, Any]) -> list[str]:
    """The ids a payload names (``-o name``): each listed object's, or else the
    one object's (an activated sandbox, a session, a hold), looked for field by
    field in :data:`NAME_FIELDS` order in the payload and the objects it holds."""
    found: list[str] = []
    for name, value in sorted(payload.items()):
        if name in ("trace_id", "error"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            found += [n for n in (_name_of(v) for v in value) if n]
    if found:
        return found
    objects = [payload, *(v for v in payload.values() if isinstance(v, Mapping))]
    for field in NAME_FIELDS:
        for value in objects:
            one = _field(value, field)
            if one:
                return [one]
    return []


def _name_of(value: Mapping[str, Any]) -> str | None:
    for field in NAME_FIELDS:
        one = _field(value, field)
        if one:
            return one
    return None


def _field(value: Mapping[str, Any], field: str) -> str | None:
    found = value.get(field)
    if isinstance(found, Mapping):  # a BoundedKey: {"key": …}
        found = found.get("key")
    return found if isinstance(found, str) and found else None


_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_./@-]*")
_RESERVED = frozenset({"true", "false", "null", "yes", "no", "on", "off", "y", "n", "~"})


def to_yaml(data: Any, indent: int = 0) -> str:
    """JSON-able data as block-style YAML (``-o yaml``): strings quoted unless
    plainly safe, so every value reads back as the JSON payload's."""
    pad = "  " * indent
    if isinstance(data, Mapping):
        if not data:
            return pad + "{}\n"
        out = []
        for key, value in sorted(data.items()):
            head = f"{pad}{_scalar(str(key))}:"
            if isinstance(value, (Mapping, list)) and value:
                out.append(head + "\n" + to_yaml(value, indent + 1))
            else:
                out.append(f"{head} {_inline(value)}\n")
        return "".join(out)
    if isinstance(data, list):
        if not data:
            return pad + "[]\n"
        out = []
        for item in data:
            if isinstance(item, (Mapping, list)) and item:
                nested = to_yaml(item, indent + 1)
                out.append(f"{pad}- " + nested[len(pad) + 2 :])
            else:
                out.append(f"{pad}- {_inline(item)}\n")
        return "".join(out)
    return pad + _inline(data) + "\n"


def _inline(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, list):
        return "[]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return _scalar(str(value))


def _scalar(text: str) -> str:
    if _PLAIN.fullmatch(text) and text.lower() not in _RESERVED:
        return text
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


def proto_dict(msg: message.Message) -> dict[str, Any]:
    """A message as JSON-able data: proto field names, enum names, every field."""
    from google.protobuf import json_format

    data: dict[str, Any] = json_format.MessageToDict(
        msg,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return data


def error_dict(error: TurnstileError) -> dict[str, Any]:
    """A decoded error as JSON-able data."""
    return {
        "code": error.code.name,
        "reason": error.reason,
        "message": error.message,
        "metadata": dict(error.metadata),
        "retry_after_s": error.retry_after_s,
        "quota_violations": [
            {"subject": v.subject, "description": v.description} for v in error.quota_violations
        ],
        "field_violations": [
            {"field": v.subject, "description": v.description} for v in error.field_violations
        ],
    }


def when(ts: Timestamp) -> str:
    """A timestamp as local wall-clock time and how far it is from now."""
    if ts.seconds == 0 and ts.nanos == 0:
        return "-"
    at = ts.ToDatetime(tzinfo=UTC)
    delta = (at - datetime.now(UTC)).total_seconds()
    ago = f"in {human_seconds(delta)}" if delta >= 0 else f"{human_seconds(-delta)} ago"
    return f"{at.astimezone().strftime('%H:%M:%S')} ({ago})"


def human_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    if seconds < 10:
        return f"{seconds:.1f} s".replace(".0 s", " s")
    if seconds < 120:
        return f"{round(seconds)} s"
    if seconds < 7200:
        return f"{round(seconds / 60)} min"
    return f"{round(seconds / 3600)} h"


def retry_text(seconds: float) -> str:
    """``retry in N s`` with N rounded up: retrying sooner is refused again."""
    return f"retry in {max(0, math.ceil(seconds - 1e-9))} s"


def queue_rows(
    rows: dict[str, object],
    response: admission_pb2.AdmitResponse | substrate_pb2.ActivateResponse,
    queue: str = "the fair queue",
) -> None:
    """Add what an Admit or Activate answer says of admission's fair queue (SPEC
    Q1): how long the call waited, and the position and estimate it joined at."""
    if response.HasField("waited"):
        rows["waited"] = f"{response.waited.ToMilliseconds() / 1000:.3f}s in {queue}"
    if response.queue_position:
        estimate = ", estimated wait unknown"
        if response.HasField("estimated_wait"):
            estimate = f", estimated {response.estimated_wait.ToMilliseconds() / 1000:.3f}s"
        rows["queue position"] = f"{response.queue_position} when it joined{estimate}"


def kv_table(rows: Mapping[str, object], *, title: str | None = None) -> Table:
    """A two-column key/value table."""
    table = Table.grid(padding=(0, 2))
    if title:
        table.title = title
        table.title_justify = "left"
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for name, value in rows.items():
        table.add_row(name, value if isinstance(value, Table) else escape(str(value)))
    return table


class Output:
    """A command's way out: ``emit`` once, ``warning`` before it when needed."""

    def __init__(
        self,
        *,
        json_mode: bool = False,
        output: str | None = None,
        color: bool | None = None,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
    ) -> None:
        #: ``json``, ``yaml``, ``name`` (machine output), ``wide`` or None (people).
        self.format = output or ("json" if json_mode else None)
        #: Machine output: one payload on stdout, no warnings or progress for people.
        self.json_mode = self.format in ("json", "yaml", "name")
        #: The command's trace id, added to every JSON payload when set.
        self.trace_id: str | None = None
        self._stdout = stdout or sys.stdout
        no_color = color is False
        force = color is True or None
        self.console = _console(self._stdout, no_color=no_color, force=force)
        self.err = _console(stderr or sys.stderr, no_color=no_color, force=force)
        if self.format == "wide":
            self.console.width = WIDE_WIDTH

    def emit(
        self, payload: Mapping[str, Any], human: Renderer, *, listed: list[str] | None = None
    ) -> None:
        """``listed``: what ``-o name`` prints, when the payload's ids are not it."""
        if self.json_mode:
            self.print_json(payload, listed=listed)
        else:
            human(self.console)

    def print_json(self, payload: Mapping[str, Any], *, listed: list[str] | None = None) -> None:
        """The payload in the machine format asked for (JSON unless ``-o``)."""
        if self.trace_id is not None and "trace_id" not in payload:
            payload = {**payload, "trace_id": self.trace_id}
        if self.format == "name":
            error = payload.get("error")
            if isinstance(error, Mapping):
                self.err.print(f"[bold red]error:[/] {escape(str(error.get('message')))}")
            shown = listed if listed is not None else names(payload)
            text = "".join(f"{name}\n" for name in shown)
        elif self.format == "yaml":
            plain = json.loads(json.dumps(payload, default=str))
            text = to_yaml(plain)
        else:
            text = json.dumps(payload, sort_keys=True, default=str) + "\n"
        self._stdout.write(text)
        self._stdout.flush()

    def warning(self, text: str) -> None:
        """A warning a person must see first (no-op in JSON mode: it is in the payload)."""
        if not self.json_mode:
            self.console.print(f"[bold black on yellow] WARNING [/] [yellow]{escape(text)}[/]")

    def note(self, text: str) -> None:
        """Progress for people, on stderr so it never mixes with data; one line,
        however long (the terminal wraps it, a pipe keeps it whole)."""
        if not self.json_mode:
            self.err.print(f"[dim]{escape(text)}[/]", soft_wrap=True)

    def target(self, text: str) -> None:
        """The one dim line on stderr naming what the command acts on (SPEC M2),
        in every output mode: stdout keeps only the answer."""
        self.err.print(f"[dim]target: {escape(text)}[/]", soft_wrap=True)

    def failure(
        self,
        text: str,
        *,
        code: str = "",
        reason: str = "",
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """A failure that is not an RPC error (bad config, a certificate problem);
        on stderr for people, so stdout holds only a command's answer. ``extra``:
        more fields of the JSON error (the stacks a missing target could be)."""
        if self.json_mode:
            error = {"code": code, "reason": reason, "message": text, **(extra or {})}
            self.print_json({"error": error})
        else:
            # One line, however long: the terminal wraps it, a pipe keeps it whole.
            self.err.print(f"[bold red]error:[/] {escape(text)}", soft_wrap=True)

    def rpc_error(self, error: TurnstileError, *, action: str) -> None:
        """A decoded RPC error: reason, limit, current value and when to retry."""
        if self.json_mode:
            self.print_json({"error": error_dict(error)})
            return
        self.err.print(render_error(error, action=action))


class TrimmedLines:
    """A stream's stand-in that drops the spaces rich pads each line with to the
    console's width: a table piped to a file or ``grep`` ends its lines where
    their text does. A line is written once whole; ``flush`` writes the rest."""

    def __init__(self, file: IO[str]) -> None:
        self.file = file
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self.file.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.file.write(self._pending)
            self._pending = ""
        self.file.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def _console(file: IO[str], *, no_color: bool, force: bool | None) -> Console:
    console = Console(file=file, no_color=no_color, force_terminal=force, highlight=False)
    if not console.is_terminal:
        if not os.environ.get("COLUMNS"):
            console.width = PIPED_WIDTH
        console.file = cast("IO[str]", TrimmedLines(file))
    return console


def render_error(error: TurnstileError, *, action: str) -> Table:
    """The human form of an error: what was refused and why, and what to do."""
    from turnstile_cli.exits import Exit, for_error

    exit_code = for_error(error)
    label, style = {
        Exit.REFUSED: ("refused", "bold red"),
        Exit.RETRYABLE: ("not yet", "bold yellow"),
        Exit.USAGE: ("invalid", "bold red"),
    }.get(exit_code, ("failed", "bold red"))
    if exit_code == Exit.RETRYABLE and not error.reason and error.retry_after_s is None:
        # A bare UNAVAILABLE or deadline: nothing says it will be "soon".
        label = "failed"
    # The reason, then the status code when it says more: never the code twice.
    name = error.reason or error.code.name
    headline = f"[{style}]✗ {action} {label}[/]: " + escape(name)
    if name != error.code.name:
        headline += f" [dim]({error.code.name})[/]"
    rows: dict[str, object] = {}
    # An INVALID_ARGUMENT's message is its field violations joined, and its
    # metadata names the first field: show each violation once, not three times.
    covered = [f"{v.subject}: {v.description}" for v in error.field_violations]
    if error.message and error.message not in ("; ".join(covered), *covered):
        rows["why"] = error.message
    meta = dict(error.metadata)
    if error.field_violations:
        meta.pop("field", None)
    for name in ("key", "policy", "bucket", "limit", "current", "sandbox_id", "tier"):
        if name in meta:
            rows[name] = meta.pop(name)
    meta.pop("key_set_version", None)
    for name, value in sorted(meta.items()):
        rows[name] = value
    if not error.reason and error.code.name == "UNAVAILABLE":
        from turnstile_platform.health_check import WRONG_SERVER_SIGNS

        if any(sign in error.message for sign in WRONG_SERVER_SIGNS):
            rows["hint"] = (
                "the server there is not the Turnstile service expected: its certificate "
                "does not hold the expected SPIFFE ID (TURNSTILE_<SERVICE>_SPIFFE_ID, default "
                "spiffe://turnstile.local/service/<service>) or is no server certificate"
            )
        else:
            rows["hint"] = "is the service running there? try: turnstilectl status (or --target)"
    for violation in error.field_violations:
        rows[f"field {violation.subject}"] = violation.description
    for quota in error.quota_violations:
        rows[f"quota {quota.subject}"] = quota.description
    table = Table.grid(padding=(0, 2))
    table.add_column()
    table.add_row(headline)
    if rows:
        table.add_row(kv_table(rows))
    if error.retry_after_s is not None and error.reason == "CAP_EXCEEDED":
        # A cap frees when a sandbox stops, not after a time.
        again = retry_text(error.retry_after_s).removeprefix("retry ")
        table.add_row(
            f"[bold]→ frees when one of the key's sandboxes stops; check again {again}[/]"
        )
    elif error.retry_after_s is not None:
        table.add_row(f"[bold]→ {retry_text(error.retry_after_s)}[/]")
    return table
