"""A progress line on the terminal for the command-line work whose time grows with the
data (``inspect``/``verify`` of an archive read every member for its checksum: minutes
for a large one, which said nothing meanwhile).

Shown only on a terminal (a redirected stderr gets nothing, so logs stay clean), only
once the work has run for ``delay`` seconds (a quick run does not flicker), redrawn at
most every ``every`` seconds, and erased at the end (the report follows as before).

Example:
    >>> import io
    >>> class Terminal(io.StringIO):
    ...     def isatty(self):
    ...         return True
    >>> out = Terminal()
    >>> line = ProgressLine("checking the archive's data", out, delay=0.0, every=0.0)
    >>> line(512 << 20, 2 << 30)
    >>> out.getvalue()
    "\\rchecking the archive's data: 512.0 MiB of 2.0 GiB (25%)"
    >>> line.close(); out.getvalue().endswith("\\r")
    True
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from shared_td.cli.common import human_bytes

__all__ = ["DELAY_S", "EVERY_S", "ProgressLine"]

#: Seconds of work before the line first shows, and at least between two redraws.
DELAY_S, EVERY_S = 1.0, 0.25


class ProgressLine:
    """``line(done, total)`` draws ``label: done of total (n%)`` over the previous one
    on ``stream`` (default: stderr) when it is a terminal; ``close()`` erases it."""

    def __init__(self, label: str, stream: TextIO | None = None, *, delay: float | None = None,
                 every: float | None = None, clock: Callable[[], float] = time.monotonic):
        self.label, self._stream = label, sys.stderr if stream is None else stream
        self._on = bool(getattr(self._stream, "isatty", lambda: False)())
        self._clock = clock
        self._delay = DELAY_S if delay is None else delay
        self._every = EVERY_S if every is None else every
        self._began, self._drawn_at, self._width = clock(), None, 0

    def __call__(self, done: int, total: int) -> None:
        if not self._on:
            return
        now = self._clock()
        if now - self._began < self._delay:
            return
        if self._drawn_at is not None and now - self._drawn_at < self._every and done < total:
            return
        percent = 100 * done // total if total else 100
        text = f"{self.label}: {human_bytes(done)} of {human_bytes(total)} ({percent}%)"
        self._stream.write("\r" + text.ljust(self._width))
        self._stream.flush()
        self._drawn_at, self._width = now, max(self._width, len(text))

    def close(self) -> None:
        """Erase the line, if one was drawn."""
        if self._drawn_at is not None:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
            self._drawn_at = None
