"""What a client id is: one rule for every field and file that carries one."""

from __future__ import annotations

#: Client ids are 1 to 63 characters (the proto says so): the length of a
#: Kubernetes label value, so every id that fits can have a label of its own.
MAX_CLIENT_ID_LENGTH = 63


def client_id_problem(client_id: str) -> str | None:
    """Why ``client_id`` cannot be a client id, or None when it can.

    One rule for every field that carries a client id (an activation's client, a
    list filter): 1 to :data:`MAX_CLIENT_ID_LENGTH` printable characters, no
    leading or trailing whitespace (``"   "`` is not a client). NUL and other
    control characters are refused here, before they reach PostgreSQL or Redis.
    """
    if not client_id:
        return "must not be empty"
    if len(client_id) > MAX_CLIENT_ID_LENGTH:
        return f"must be at most {MAX_CLIENT_ID_LENGTH} characters"
    if not client_id.isprintable():
        return "must be printable characters (no NUL or control characters)"
    if client_id != client_id.strip():
        return "must not be blank or begin or end with whitespace"
    return None
