"""A one-line progress display with no dependencies, and the number formats it uses.

On a terminal the line is redrawn in place (``\\r``); into a pipe or a file (CI logs,
tests) it prints a plain line at most every ``every`` seconds, so logs stay short.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> line = ProgressLine(out, width=10)
    >>> line.update(0.5, "written 1.2k/s", force=True)
    >>> line.close()
    >>> out.getvalue()
    '[#####.....]  50% written 1.2k/s\\n'
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressLine", "count", "rate", "size"]


class ProgressLine:
    """Draws ``[#####.....]  50% <text>`` on ``stream`` (default: stdout).

    Args:
        stream: where to draw.
        width: characters of the bar.
        every: seconds between two lines when ``stream`` is not a terminal.
    """

    def __init__(self, stream: TextIO | None = None, *, width: int = 24, every: float = 1.0):
        self.stream = stream if stream is not None else sys.stdout
        self.width = width
        self.every = every
        isatty = getattr(self.stream, "isatty", None)
        self.in_place = bool(isatty and isatty())
        self._last_print = float("-inf")
        self._last_length = 0
        self._pending = False

    def update(self, fraction: float, text: str, *, force: bool = False) -> None:
        """Show ``fraction`` (0..1) done and ``text``; ``force`` prints even between
        two ``every`` ticks of a non-terminal stream."""
        now = time.monotonic()
        if not (self.in_place or force or now - self._last_print >= self.every):
            return
        fraction = min(max(fraction, 0.0), 1.0)
        filled = round(fraction * self.width)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {fraction:4.0%} {text}"
        if self.in_place:
            # pad with spaces so a shorter line wipes the end of the previous one
            self.stream.write("\r" + line.ljust(self._last_length))
            self._last_length = len(line)
            self._pending = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._last_print = now

    def close(self) -> None:
        """End the in-place line, so what is printed next starts on a new line."""
        if self._pending:
            self.stream.write("\n")
            self.stream.flush()
            self._pending = False


def count(n: float) -> str:
    """A count in at most four characters and a unit: ``12345 -> '12.3k'``.

    Example:
        >>> count(999), count(12345), count(999_999), count(2.5e6)
        ('999', '12.3k', '1.0M', '2.5M')
    """
    value, unit = float(n), ""
    for bigger in ("k", "M", "G"):
        if abs(value) < 999.5:
            break
        value, unit = value / 1000, bigger
    if not unit:
        return f"{value:.3g}"
    return f"{value:.1f}{unit}" if abs(value) < 99.95 else f"{value:.0f}{unit}"


def rate(n: float, seconds: float) -> str:
    """``n`` per second, formatted like :func:`count`, with ``/s``.

    Example:
        >>> rate(50000, 2.0)
        '25.0k/s'
    """
    return f"{count(n / seconds if seconds > 0 else 0.0)}/s"


def size(nbytes: float) -> str:
    """Bytes in binary units.

    Example:
        >>> size(512), size(3 * 2**20)
        ('512 B', '3.0 MiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
