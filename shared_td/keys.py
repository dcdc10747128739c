"""Nested keys.

A key of a tensordict is a ``str`` or a tuple of ``str`` that walks into nested
tensordicts: ``td["a", "b"]`` is ``td["a"]["b"]``.  Tuples may themselves be nested,
as in tensordict (``("a", ("b", "c"))`` is ``("a", "b", "c")``).
"""
from __future__ import annotations

from typing import Tuple, Union

from shared_td.errors import KeyTypeError

NestedKey = Union[str, Tuple["NestedKey", ...]]


def unravel_key(key: NestedKey) -> tuple[str, ...]:
    """Return ``key`` as a flat, non-empty tuple of strings.

    Examples:
        >>> unravel_key("a")
        ('a',)
        >>> unravel_key(("a", ("b", "c")))
        ('a', 'b', 'c')

    Raises:
        KeyTypeError: (a TypeError and a KeyError) if the key (or one of its parts) is not a ``str`` or a tuple of them.
        ValueError: if the key is an empty tuple.
    """
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple):
        parts: list[str] = []
        for part in key:
            parts.extend(unravel_key(part))
        if not parts:
            raise ValueError("An empty tuple is not a key: give at least one str.")
        return tuple(parts)
    raise KeyTypeError(
        f"Keys of a tensordict are str or tuples of str, got {key!r} "
        f"of type {type(key).__name__}. Convert it with str() first."
    )


def is_nested_key(key: object) -> bool:
    """True if ``key`` is a str or a (possibly nested) tuple of str."""
    try:
        unravel_key(key)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def key_repr(key: tuple[str, ...]) -> str:
    """How error messages show a key: ``'a'`` or ``('a', 'b')``."""
    return repr(key[0]) if len(key) == 1 else repr(key)
