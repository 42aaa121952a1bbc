"""``traces``: the local stack's last traces, as trees.

Reads the span log the stack's own OTLP receiver writes
(:mod:`turnstile_cli.stack.otlp_receiver`), groups spans by trace, hangs each
under its parent and shows the newest traces first: span name, service,
duration and status. With ``-o json`` the same trees as nested objects. When the
stack sends its spans to a Jaeger (a ``jaeger`` binary on ``PATH``) or to your
``OTEL_EXPORTER_OTLP_ENDPOINT``, there is no span log: it says where they went.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.tree import Tree

from turnstile_cli.context import Context
from turnstile_cli.exits import Exit
from turnstile_cli.stack import state
from turnstile_cli.stack.otlp_receiver import read_spans


@dataclass
class Node:
    span: dict[str, Any]
    children: list[Node] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return max(0, int(self.span["end_ns"]) - int(self.span["start_ns"])) / 1e6

    def as_dict(self) -> dict[str, Any]:
        s = self.span
        return {
            "name": s["name"],
            "service": s["service"],
            "span_id": s["span_id"],
            "kind": s.get("kind", ""),
            "duration_ms": round(self.duration_ms, 3),
            "status": s.get("status", "UNSET"),
            **({"status_message": s["status_message"]} if s.get("status_message") else {}),
            "children": [c.as_dict() for c in self.children],
        }


@dataclass
class Trace:
    trace_id: str
    roots: list[Node]
    spans: int
    start_ns: int
    end_ns: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "spans": self.spans,
            "start_unix_ns": self.start_ns,
            "duration_ms": round(max(0, self.end_ns - self.start_ns) / 1e6, 3),
            "roots": [r.as_dict() for r in self.roots],
        }


def build(spans: list[dict[str, Any]]) -> list[Trace]:
    """Every trace in ``spans``, newest (by its last span's end) first. A span whose
    parent is not among them (not exported yet, or sampled out) is a root."""
    by_trace: dict[str, dict[str, Node]] = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], {})[span["span_id"]] = Node(span)
    traces = []
    for trace_id, nodes in by_trace.items():
        roots: list[Node] = []
        for node in nodes.values():
            parent = nodes.get(node.span.get("parent_span_id", ""))
            (parent.children if parent is not None else roots).append(node)
        for node in nodes.values():
            node.children.sort(key=lambda n: int(n.span["start_ns"]))
        roots.sort(key=lambda n: int(n.span["start_ns"]))
        traces.append(
            Trace(
                trace_id=trace_id,
                roots=roots,
                spans=len(nodes),
                start_ns=min(int(n.span["start_ns"]) for n in nodes.values()),
                end_ns=max(int(n.span["end_ns"]) for n in nodes.values()),
            )
        )
    traces.sort(key=lambda t: t.end_ns, reverse=True)
    return traces


def _label(node: Node) -> str:
    s = node.span
    status = s.get("status", "UNSET")
    mark = "[red]ERROR[/]" if status == "ERROR" else ("[green]OK[/]" if status == "OK" else "")
    message = f" [red]{escape(s['status_message'])}[/]" if s.get("status_message") else ""
    kind = " [dim](client)[/]" if s.get("kind") == "client" else ""
    return (
        f"[bold]{escape(s['name'])}[/]{kind}  [cyan]{escape(s['service'] or '?')}[/]  "
        f"{node.duration_ms:.1f} ms {mark}{message}"
    ).rstrip()


def _tree(parent: Tree, node: Node) -> None:
    branch = parent.add(_label(node))
    for child in node.children:
        _tree(branch, child)


def render(console: Console, traces: list[Trace]) -> None:
    import time

    for trace in traces:
        when = time.strftime("%H:%M:%S", time.localtime(trace.start_ns / 1e9))
        tree = Tree(
            f"trace [bold]{trace.trace_id}[/] · {when} · "
            f"{(trace.end_ns - trace.start_ns) / 1e6:.1f} ms · {trace.spans} span(s)"
        )
        for root in trace.roots:
            _tree(tree, root)
        console.print(tree)


def span_dir(ctx: Context) -> tuple[Path | None, str]:
    """Where the stack's receiver writes its span log, or None with the reason
    (no stack known, or its spans go to a Jaeger or your own collector)."""
    if ctx.stack is None:
        return None, "no local stack found: traces are read from the one ./scripts/up runs"
    described = state.read(ctx.stack.path) or {}
    traces = described.get("traces")
    if not isinstance(traces, dict):
        return None, "the running stack records no traces (started by an older turnstilectl up)"
    directory = traces.get("dir")
    if traces.get("kind") == "receiver" and isinstance(directory, str):
        return Path(directory), ""
    if traces.get("kind") == "off":
        return None, "the stack exports no traces (it was started with OTEL_TRACES_EXPORTER=none)"
    where = traces.get("ui") or traces.get("endpoint") or "?"
    return None, f"the stack sends its traces to {where}: look there"


async def _traces(args: argparse.Namespace, ctx: Context) -> int:
    directory, why = span_dir(ctx)
    if directory is None:
        ctx.out.failure(why, code="UNAVAILABLE")
        return Exit.RETRYABLE
    found = build(read_spans(directory))
    if args.trace_id:
        found = [t for t in found if t.trace_id == args.trace_id.lower()]
    if args.service:
        found = [t for t in found if any(_has_service(r, args.service) for r in t.roots)]
    shown = found[: args.limit] if args.limit else found
    ctx.out.emit(
        {"traces": [t.as_dict() for t in shown]},
        lambda console: (
            render(console, shown)
            if shown
            else ctx.out.note(
                f"no traces yet in {directory} (they arrive within a second of a call)"
            )
        ),
    )
    return Exit.OK


def _has_service(node: Node, service: str) -> bool:
    return node.span["service"] == service or any(_has_service(c, service) for c in node.children)
