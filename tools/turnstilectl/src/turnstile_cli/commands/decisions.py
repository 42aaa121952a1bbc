"""``why SANDBOX`` and ``decisions``: the decision log (SPEC Q3), read through
admission's ``ListDecisions``.

``why`` tells a sandbox's last activations and what decided each, in plain words,
with the trace id to look up; ``decisions`` lists entries (filtered by client,
sandbox and age) as a table or JSON, and ``--follow`` keeps printing new ones — with
``-o json`` one JSON object a line, for a log shipper.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import proto_dict, when
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform.shared_limits import CONTENDED

#: Page size of ``decisions`` and ``why`` reads, and of each ``--follow`` poll.
PAGE = 100
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

KIND_STYLES = {
    "admitted": "green",
    "refused": "bold red",
    "shadow_refused": "yellow",
    "refused_by_admission": "bold red",
    "runtime_failed": "bold red",
    "limits_changed": "magenta",
    "keys_changed": "magenta",
}

#: A policy's limit and current value in words (``{c}`` current, ``{l}`` limit).
_MEASURES: dict[int, str] = {
    admission_pb2.POLICY_CAP: "{c} of {l} sandboxes live or pending",
    admission_pb2.POLICY_RATE: "{c} token(s) left of a burst of {l}",
    admission_pb2.POLICY_CONCURRENCY: "{c} of {l} activations in flight",
    admission_pb2.POLICY_NODE_SLOTS: "{c} of {l} node slots held",
}


def styled(kind: str) -> str:
    """``kind`` in words, coloured by what it means (plain when it has no colour)."""
    words = escape(kind.replace("_", " "))
    style = KIND_STYLES.get(kind)
    return f"[{style}]{words}[/]" if style else words


def duration_s(text: str) -> float:
    """``10m``, ``90s``, ``2h``, ``1d``, ``500ms`` as seconds (argparse type)."""
    match = _DURATION.match(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 90s, 10m, 2h or 1d")
    return float(match[1]) * _UNIT_S[match[2]]


def policy_name(policy: int) -> str:
    return admission_pb2.Policy.Name(policy).removeprefix("POLICY_").lower()  # type: ignore[arg-type]


def _measure(policy: int, limit: int, current: int) -> str:
    return _MEASURES.get(policy, "{c} of {l}").format(c=current, l=limit)


def explain(d: admission_pb2.LoggedDecision) -> str:
    """What decided ``d``, in plain words."""
    if d.service != "admission":
        return d.detail or d.kind.replace("_", " ")
    if d.HasField("change"):  # the admin API's audit entry (SPEC M1)
        c = d.change
        return (
            f"{c.verb} {c.target} by {d.identity or 'an unauthenticated caller'}: "
            f"{c.previous or 'none'} → {c.current or 'none'}"
        )
    key = d.key.key or "?"
    shadow = [
        f"a shadow {policy_name(s.policy)} limit would have refused "
        f"({_measure(s.policy, s.limit, s.current)})"
        for s in d.shadow_verdicts
        if s.verdict == admission_pb2.VERDICT_SHADOW_REFUSE
    ]
    shadow += [
        f"{policy_name(v.policy)} (in shadow mode) would have refused "
        f"({_measure(v.policy, v.limit, v.current)})"
        for v in d.verdicts
        if v.verdict == admission_pb2.VERDICT_SHADOW_REFUSE
    ]
    if d.kind == "refused":
        refused = next((v for v in d.verdicts if v.verdict == admission_pb2.VERDICT_REFUSE), None)
        if refused is None:
            text = f"refused for key {key}"
        elif refused.detail == CONTENDED:
            # A shared limit, as a tenant reads it: no numbers (SPEC N5).
            text = f"refused for key {key}: {CONTENDED}"
        else:
            detail = f" ({refused.detail})" if refused.detail else ""
            text = (
                f"refused by the {policy_name(refused.policy)} limit of key {key}: "
                f"{_measure(refused.policy, refused.limit, refused.current)}{detail}"
            )
    else:
        text = f"admitted as key {key}"
        if d.node:
            text += f" on node {d.node}"
        unknown = [
            f"{policy_name(v.policy)} could not decide ({v.detail or 'unknown'})"
            for v in d.verdicts
            if v.verdict == admission_pb2.VERDICT_UNKNOWN
        ]
        if unknown:
            text += "; " + "; ".join(unknown)
    if d.HasField("waited"):
        text += f"; after waiting {d.waited.ToMilliseconds() / 1000:.3f}s in the fair queue"
    if shadow:
        text += "; " + "; ".join(shadow)
    return text


def entry_dict(d: admission_pb2.LoggedDecision) -> dict[str, Any]:
    """An entry as JSON-able data, with its explanation (``why``)."""
    return {**proto_dict(d), "why": explain(d)}


def _request(args: argparse.Namespace, **extra: Any) -> admission_pb2.ListDecisionsRequest:
    request = admission_pb2.ListDecisionsRequest(
        client_id=getattr(args, "client", None) or "",
        sandbox_id=getattr(args, "sandbox", None) or "",
        **extra,
    )
    since = getattr(args, "since", None)
    if since:
        request.since.FromMilliseconds(int((time.time() - since) * 1000))
    return request


async def _decisions(args: argparse.Namespace, ctx: Context) -> int:
    async with ctx.admission() as stub:
        page = await stub.ListDecisions(_request(args, limit=args.limit))
        entries = list(page.decisions)
        if not args.follow:
            payload = {"decisions": [entry_dict(d) for d in entries]}
            ctx.out.emit(payload, lambda console: console.print(table(entries)))
            return Exit.OK
        # Oldest first from here on: a follower prints in the order things happened.
        newest = entries[0].id if entries else ""
        for d in reversed(entries):
            _follow_print(ctx, d)
        polls = 0
        while args.polls == 0 or polls < args.polls:
            polls += 1
            await asyncio.sleep(args.interval)
            if newest:
                fresh = await newer_than(stub, args, newest)
            else:
                fresh = list((await stub.ListDecisions(_request(args, limit=PAGE))).decisions)
            if fresh:
                newest = fresh[0].id
            for d in reversed(fresh):
                _follow_print(ctx, d)
    return Exit.OK


async def newer_than(
    stub: Any, args: argparse.Namespace, after: str
) -> list[admission_pb2.LoggedDecision]:
    """Every entry newer than ``after``, newest first: pages back until the page that
    reaches it, so a burst of more than a page between two polls is not skipped."""
    extra: dict[str, Any] = {"limit": PAGE, "after": after}
    found: list[admission_pb2.LoggedDecision] = []
    while True:
        page = await stub.ListDecisions(_request(args, **extra))
        found.extend(page.decisions)
        if not page.next_before:
            return found
        extra["before"] = page.next_before


def _follow_print(ctx: Context, d: admission_pb2.LoggedDecision) -> None:
    if ctx.out.json_mode:
        ctx.out.print_json(entry_dict(d))  # one JSON object a line
    else:
        ctx.out.console.print(
            f"{when(d.at)}  {styled(d.kind)}  {escape(d.sandbox_id)}  "
            f"{escape(explain(d))}  [dim]trace {d.trace_id or '-'}[/]",
            soft_wrap=True,
        )


def table(entries: Sequence[admission_pb2.LoggedDecision]) -> Table:
    out = Table(title="decisions, newest first", title_justify="left")
    for column in ("when", "service", "kind", "sandbox", "client", "why", "trace"):
        out.add_column(column)
    for d in entries:
        out.add_row(
            when(d.at),
            d.service,
            styled(d.kind),
            escape(d.sandbox_id),
            escape(d.client),
            escape(explain(d)),
            d.trace_id or "-",
        )
    return out


async def _why(args: argparse.Namespace, ctx: Context) -> int:
    async with ctx.admission() as stub:
        page = await stub.ListDecisions(
            admission_pb2.ListDecisionsRequest(
                client_id=args.client or "", sandbox_id=args.sandbox_id, limit=args.last
            )
        )
    entries = list(page.decisions)
    payload = {"sandbox_id": args.sandbox_id, "decisions": [entry_dict(d) for d in entries]}
    ctx.out.emit(payload, lambda console: render_why(console, args.sandbox_id, entries))
    return Exit.OK if entries else Exit.ERROR


def render_why(
    console: Console, sandbox_id: str, entries: Sequence[admission_pb2.LoggedDecision]
) -> None:
    if not entries:
        console.print(
            f"no decision about sandbox [bold]{escape(sandbox_id)}[/] in the decision log "
            "(none yet, trimmed by its bounds, or decided while Redis was unreachable: "
            "see the admission log for 'not in the decision log')"
        )
        return
    console.print(f"sandbox [bold]{escape(sandbox_id)}[/]: its last activations, newest first")
    versions = key_set_versions(entries)
    for d in entries:
        activation = (
            common_pb2.ActivationKind.Name(d.activation_kind)
            .removeprefix("ACTIVATION_KIND_")
            .lower()
            .replace("_", " ")
            if d.activation_kind
            else ""
        )
        head = f"{when(d.at)}  {styled(d.kind)}"
        head += (
            f"  ({activation}, {escape(d.service)})" if activation else f"  ({escape(d.service)})"
        )
        console.print(head)
        console.print(f"    {escape(explain(d))}", soft_wrap=True)
        who = d.identity or "(no caller identity: plaintext)"
        version = versions.get(d.id)
        console.print(
            f"    [dim]trace {d.trace_id or '-'}"
            f"{'' if d.sampled or not d.trace_id else ' (not sampled)'}, caller {escape(who)}, "
            f"client {escape(d.client or '-')}"
            f"{'' if version is None else f', key set v{version}'}[/]",
            soft_wrap=True,
        )


def key_set_versions(entries: Sequence[admission_pb2.LoggedDecision]) -> dict[str, int]:
    """The key set version to show beside each entry, by entry id: one per decision.

    Admission records the version it resolved the key with; the substrate's and
    affinity's entries record none (0 on the wire), so each shows the version of
    admission's entry under the same trace, or none at all rather than a made-up v0."""
    by_trace = {
        d.trace_id: d.key.key_set_version
        for d in entries
        if d.service == "admission" and d.trace_id and d.HasField("key")
    }
    shown: dict[str, int] = {}
    for d in entries:
        if d.service == "admission" or d.key.key_set_version:
            shown[d.id] = d.key.key_set_version
        elif d.trace_id in by_trace:
            shown[d.id] = by_trace[d.trace_id]
    return shown
