"""What the commands share: their errors and how they print sizes, JSON and names."""
from __future__ import annotations

import json
import sys


class UsageError(Exception):
    """The command line itself is wrong (exit code 2)."""


class CommandError(Exception):
    """The command cannot do what was asked (exit code 1); the message says why."""


def shown(text: str) -> str:
    r"""``text`` safe for a terminal and unambiguous: each non-printable character
    (newline, carriage return, escape, ...) written as in a Python literal, and each
    backslash doubled, so that a file or key name cannot forge a line of the report or
    drive the terminal, and two different names never print the same (a name holding a
    backslash and an ``n`` is shown ``a\\nb``, one holding a newline ``a\nb``).

    Examples:
        >>> print(shown("a\nb\x1b[31m c"))
        a\nb\x1b[31m c
        >>> print(shown("a\\nb"))
        a\\nb
    """
    if text.isprintable() and "\\" not in text:
        return text
    return "".join("\\\\" if c == "\\" else c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(error: BaseException) -> str:
    r"""What ``error`` says, on one line (its whitespace collapsed), or its type's name
    when it says nothing: the words of a failure on stderr and of a refused PATH in a
    --json document, so that both say the same.

    Examples:
        >>> one_line(OSError("cannot look at /x:\n  Permission denied")), one_line(KeyError())
        ('cannot look at /x: Permission denied', 'KeyError')
    """
    return " ".join(str(error).split()) or type(error).__name__


def print_lines(lines: list[str]) -> None:
    """Print a report, one line each, with every line passed through :func:`shown`."""
    print("\n".join(shown(line) for line in lines))


def human_bytes(count: int) -> str:
    """``1536`` -> ``'1.5 KiB'``; exact below 1 KiB.

    Examples:
        >>> human_bytes(48), human_bytes(1536), human_bytes(256 << 20)
        ('48 B', '1.5 KiB', '256.0 MiB')
    """
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    value, unit = float(count), 0
    while value >= 1024 and unit < len(units) - 1:
        value, unit = value / 1024, unit + 1
    return f"{count} B" if unit == 0 else f"{value:.1f} {units[unit]}"


def plural(count: int, word: str) -> str:
    """``plural(1, "leaf")`` -> ``'1 leaf'``; irregular plurals are spelt out below."""
    forms = {"leaf": "leaves", "prefix": "prefixes"}
    return f"{count} {word if count == 1 else forms.get(word, word + 's')}"


def print_json(document: object) -> None:
    """Machine-readable output: one JSON document on stdout."""
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")
