"""What the commands share: their errors and how they print sizes and JSON."""
from __future__ import annotations

import json
import sys


class UsageError(Exception):
    """The command line itself is wrong (exit code 2)."""


class CommandError(Exception):
    """The command cannot do what was asked (exit code 1); the message says why."""


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
