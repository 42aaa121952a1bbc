"""Reading the emulator's requests and writing its responses as the API server does."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from turnstile_testing.kube_emulator.errors import bad_request

#: What Go's ``strconv.ParseBool`` reads as true.
TRUE = frozenset({"1", "t", "true"})
_FALSE = frozenset({"0", "f", "false", ""})

JSON = "application/json"


def json_response(body: bytes, status: int = 200) -> web.Response:
    return web.Response(body=body, status=status, content_type=JSON)


async def json_body(request: web.Request) -> Any:
    """The request's JSON body, or 400 as the API server words it."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"error decoding request body: {exc}") from None


async def delete_options(request: web.Request) -> dict[str, Any]:
    """A DELETE's ``DeleteOptions`` body; empty when there is none."""
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        options = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"error decoding DeleteOptions: {exc}") from None
    return options if isinstance(options, dict) else {}


def parse_bool(name: str, value: str | None) -> bool:
    """Query booleans as Go's ``strconv.ParseBool`` reads them (``watch=True`` included)."""
    if value is None:
        return False
    lowered = value.lower()
    if lowered in TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise bad_request(f'invalid boolean value for "{name}": {value}')
