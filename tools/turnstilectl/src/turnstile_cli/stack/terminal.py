"""The runner's output, which may lose its reader at any moment.

``./scripts/up 2>&1 | tee up.log`` and Ctrl-C: the terminal sends SIGINT to the
whole foreground group, so ``tee`` dies at once while the runner starts to stop.
Its next line then fails with ``EPIPE`` (Python ignores SIGPIPE and raises
``BrokenPipeError``), and a closed terminal fails writes with ``EIO``. A runner
that let that error escape would die half-way through its stop and leave every
runtime and its Prometheus running. So a write that finds its reader gone moves
the runner's standard output and error onto a log file (``dup2``: every later
line, tracebacks included, goes there) and is written again there; the stop goes
on, and what it says is in that file.

The person who pressed Ctrl-C still looks at the terminal, though: ``tee`` died,
the terminal did not. So once the stop is over, a runner whose reader went away
writes the stop's own lines to its controlling terminal too (``/dev/tty``, when it
has one: :meth:`DetachingOutput.tell_terminal`), where they land before the
shell's prompt. Not after SIGHUP: that terminal is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import IO, Any

#: A write that fails with one of these has lost its reader: the pipe's far end
#: (EPIPE) or the terminal (EIO).
_GONE = (errno.EPIPE, errno.EIO)

#: Why the output moved when a write found its reader gone.
READER_GONE = "the output's reader went away"


def detach_to(log: Path) -> bool:
    """Send this process's standard output and error to ``log`` (truncated).
    False when the log cannot be opened (the output stays where it was)."""
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return False
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    return True


class DetachingOutput:
    """A text stream that moves to ``log`` the first time its reader is gone.

    It wraps the console's stream (standard output): ``write`` and ``flush`` that
    fail with EPIPE or EIO detach (:func:`detach_to`) and try once more, now into
    the log. The wrapped stream's file descriptor is 1, so after the ``dup2`` it
    is the log, and the data its buffer still held is written there.
    """

    def __init__(self, inner: IO[str], log: Path) -> None:
        self._inner = inner
        self.log = log
        #: Why the output was moved to the log, once it was ("" until then).
        self.detached = ""

    @property
    def reader_lost(self) -> bool:
        """Whether a write found the reader gone (not a hang-up told in advance)."""
        return self.detached == READER_GONE

    def tell_terminal(self, lines: list[str]) -> bool:
        """Write ``lines`` to the controlling terminal, if there is one and it takes
        them; False otherwise (no terminal, or it is gone too)."""
        text = "".join(f"{line}\n" for line in lines).encode(errors="replace")
        try:
            fd = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError:  # ENXIO: no controlling terminal
            return False
        try:
            while text:
                text = text[os.write(fd, text) :]
        except OSError:  # EIO: hung up; EAGAIN: a terminal nobody drains
            return False
        finally:
            os.close(fd)
        return True

    def detach(self, why: str) -> None:
        """Move the output to the log now (SIGHUP: nobody reads the terminal)."""
        if not self.detached and detach_to(self.log):
            self.detached = why

    def write(self, text: str) -> int:
        try:
            return self._inner.write(text)
        except OSError as error:
            self._lost(error)
            return self._inner.write(text)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError as error:
            self._lost(error)
            with contextlib.suppress(OSError):
                self._inner.flush()

    def _lost(self, error: OSError) -> None:
        if error.errno not in _GONE or self.detached:
            raise error
        self.detach(READER_GONE)
        if not self.detached:
            raise error

    def __getattr__(self, name: str) -> Any:
        # isatty, fileno, encoding...: the wrapped stream's.
        return getattr(self._inner, name)
