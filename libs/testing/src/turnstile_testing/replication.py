"""A PostgreSQL primary with a streaming standby, for switchover and failover tests.

The primary is a :class:`~turnstile_testing.processes.PostgresProcess`; the standby
is a base backup of it taken with ``pg_basebackup -R`` (which writes
``standby.signal`` and the ``primary_conninfo`` that makes it stream), started on a
port of its own. Both run as the ``postgres`` user when the kit runs as root, like
every server the kit starts.

**Asynchronous replication** by default. A planned switchover
(:meth:`PostgresPair.switchover`: ``pg_ctl stop -m fast`` on the primary, then
``pg_ctl promote`` on the standby) loses nothing with it: a fast shutdown writes a
shutdown checkpoint and keeps its WAL senders running until the standby has
received everything up to it, so the promoted standby has every committed
transaction (the tests check this). A crash (:meth:`PostgresPair.crash`: the
primary SIGKILLed, then the standby promoted) hands nothing over, so an
asynchronous standby may lack the last commits the primary acknowledged (the
primary here also runs ``synchronous_commit=off``, so it may not even have
written them). ``PostgresPair(synchronous=True)`` makes every commit wait until
the standby has flushed it (``synchronous_standby_names = '*'``,
``synchronous_commit = on`` for the ``postgres`` role): a crash then loses no
acknowledged commit, at a round trip per commit, and with one standby the
primary's commits wait for ever once the standby is gone.

:attr:`PostgresPair.url` names both hosts with ``target_session_attrs=read-write``,
as a user's multi-host URL does (SPEC F7): clients find whichever is the primary.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from turnstile_testing.processes import PostgresProcess


class StandbyProcess(PostgresProcess):
    """A hot standby streaming from ``primary`` (which must be running when it starts
    the first time: its data directory is a base backup of the primary's)."""

    def __init__(self, primary: PostgresProcess, port: int | None = None) -> None:
        super().__init__(port)
        self.primary = primary

    def _initialise(self) -> None:
        self._run(
            self._binary("pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            "postgres",
            "-D",
            str(self.data),
            "-R",  # standby.signal + primary_conninfo: start as a streaming standby
            "-X",
            "stream",
            "-c",
            "fast",  # checkpoint now rather than wait for the next one
            "--no-sync",
        )

    def promote(self) -> None:
        """End recovery: the standby becomes a primary (``pg_ctl promote`` waits for it)."""
        self._run(self._binary("pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote")


@dataclass(frozen=True)
class Switchover:
    """How long each step of a switchover took (seconds)."""

    #: ``pg_ctl stop -m fast`` on the primary, until it had exited.
    stop_s: float
    #: ``pg_ctl promote`` on the standby, until it accepted writes.
    promote_s: float

    @property
    def total_s(self) -> float:
        """From the primary's stop to the new primary accepting writes: no primary at all."""
        return self.stop_s + self.promote_s


@dataclass(frozen=True)
class Crash:
    """How long a crash failover took (seconds)."""

    #: SIGKILL of the primary's processes.
    kill_s: float
    #: ``pg_ctl promote`` on the standby, until it accepted writes.
    promote_s: float

    @property
    def total_s(self) -> float:
        """From the kill to the new primary accepting writes: no primary at all."""
        return self.kill_s + self.promote_s


class PostgresPair:
    """A primary (``first``) and its streaming standby (``second``) on two ports."""

    def __init__(self, *, synchronous: bool = False) -> None:
        self.first = PostgresProcess()
        self.second = StandbyProcess(self.first)
        self.synchronous = synchronous

    def start(self) -> PostgresPair:
        self.first.start()
        self.second.start()
        self.wait_streaming()
        if self.synchronous:
            # On the primary only, after the base backup: a promoted standby that still
            # named a synchronous standby would wait for ever for one to commit.
            # The role setting is a catalog row, replicated (as it should: it is the
            # same database either side).
            self.first.query("ALTER ROLE postgres SET synchronous_commit = 'on'")
            self.first.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
            self.first.query("SELECT pg_reload_conf()")
            self.wait_synchronous()
        return self

    @property
    def url(self) -> str:
        """Both hosts, the original primary first, connecting to whichever is writable."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.first.port},127.0.0.1:{self.second.port}"
            "/postgres?target_session_attrs=read-write"
        )

    def with_database(self, name: str) -> str:
        """:attr:`url` for database ``name`` instead of ``postgres``."""
        return self.url.replace("/postgres?", f"/{name}?")

    def wait_streaming(self, timeout_s: float = 30.0) -> None:
        """Until the primary reports the standby streaming (polled: no event to await)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.first.query("SELECT state FROM pg_stat_replication") == "streaming":
                return
            time.sleep(0.05)
        raise TimeoutError(f"the standby was not streaming within {timeout_s:.0f}s")

    def wait_synchronous(self, timeout_s: float = 30.0) -> None:
        """Until the primary counts the standby as synchronous (polled: no event)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.first.query("SELECT sync_state FROM pg_stat_replication") == "sync":
                return
            time.sleep(0.05)
        raise TimeoutError(f"the standby was not synchronous within {timeout_s:.0f}s")

    def crash(self) -> Crash:
        """SIGKILL the primary (no shutdown, no WAL handed over), then promote the standby."""
        started = time.monotonic()
        self.first.kill()
        killed = time.monotonic()
        self.second.promote()
        return Crash(killed - started, time.monotonic() - killed)

    def switchover(self) -> Switchover:
        """Stop the primary (fast: a clean shutdown that hands the standby all its WAL),
        then promote the standby."""
        started = time.monotonic()
        self.first.stop("fast")
        stopped = time.monotonic()
        self.second.promote()
        return Switchover(stopped - started, time.monotonic() - stopped)

    def close(self) -> None:
        self.second.close()
        self.first.close()


@contextmanager
def postgres_pair(*, synchronous: bool = False) -> Iterator[PostgresPair]:
    """A started :class:`PostgresPair`, removed afterwards."""
    pair = PostgresPair(synchronous=synchronous)
    try:
        yield pair.start()
    finally:
        pair.close()
