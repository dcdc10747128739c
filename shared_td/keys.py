"""Nested keys.

A key of a tensordict is a ``str`` or a tuple of ``str`` that walks into nested
tensordicts: ``td["a", "b"]`` is ``td["a"]["b"]``.  Tuples may themselves be nested,
as in tensordict (``("a", ("b", "c"))`` is ``("a", "b", "c")``).
"""
from __future__ import annotations

import os
import re
from typing import Tuple, Union

from shared_td.errors import KeyTypeError

NestedKey = Union[str, Tuple["NestedKey", ...]]

#: The default that makes ``td.get(key, RAISE)`` raise the KeyError naming a missing key
#: (a plain ``get`` gives None, as tensordict's): for the code in this package that needs
#: the entry.
RAISE = object()


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
        if type(key) is tuple and key and all(isinstance(part, str) for part in key):
            return key  # already flat: the common case of every nested get/set
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


def unravel_key_to_tuple(key: object) -> tuple[str, ...]:
    """``key`` as a flat tuple of strings, as :func:`unravel_key`, but ``()`` for what
    is not a key instead of an error (tensordict 0.15.3's ``unravel_key_to_tuple``).

    Examples:
        >>> unravel_key_to_tuple("a"), unravel_key_to_tuple(("a", ("b", ("c",)))), unravel_key_to_tuple(("a", 1))
        (('a',), ('a', 'b', 'c'), ())
    """
    return unravel_key(key) if is_nested_key(key) else ()


def is_below(key: tuple[str, ...], other: tuple[str, ...]) -> bool:
    """Whether the flat key ``key`` names an entry inside the entry ``other`` (strictly).

    Example:
        >>> is_below(("a", "b"), ("a",)), is_below(("a",), ("a",)), is_below(("ab",), ("a",))
        (True, False, False)
    """
    return len(key) > len(other) and key[:len(other)] == other


def canonical_key(key: NestedKey) -> NestedKey:
    """``key`` in tensordict's canonical form: a ``str`` for one part, else a flat tuple.

    This is what ``shared_td.unravel_key`` (like ``tensordict.unravel_key``) returns;
    internally keys are always tuples (:func:`unravel_key`).

    Examples:
        >>> canonical_key(("a",)), canonical_key(("a", ("b", "c")))
        ('a', ('a', 'b', 'c'))
    """
    parts = unravel_key(key)
    return parts[0] if len(parts) == 1 else parts


def unravel_key_list(keys: list | tuple) -> list:
    """Each of ``keys`` as :func:`canonical_key` gives it (``shared_td.unravel_key``),
    as tensordict's ``unravel_key_list``.

    Examples:
        >>> unravel_key_list(["a", ("b",), ("c", ("d",))])
        ['a', 'b', ('c', 'd')]

    Raises:
        TypeError: ``keys`` is not a list or a tuple (or a key is not a nested key).
    """
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"unravel_key_list() takes a list or a tuple of keys, got {type(keys).__name__}.")
    return [canonical_key(key) for key in keys]


def is_nested_key(key: object) -> bool:
    """True if ``key`` is a str or a (possibly nested) non-empty tuple of str.

    A plain predicate, with no exception and no message: it runs on every ``td[index]``
    to tell a key from an index, and formatting the index (an error message of
    ``unravel_key``) would cost more than the indexing itself.

    Examples:
        >>> is_nested_key(("a", ("b", "c"))), is_nested_key(("a", 0)), is_nested_key(())
        (True, False, False)
    """
    if isinstance(key, str):
        return True
    return isinstance(key, tuple) and bool(key) and all(is_nested_key(part) for part in key)


def key_repr(key: tuple[str, ...]) -> str:
    """How error messages show a key: ``'a'`` or ``('a', 'b')``."""
    return repr(key[0]) if len(key) == 1 else repr(key)


# ---------------------------------------------------------------------------------------
# File names of keys (the on-disk format, byte-compatible with tensordict 0.15.3)
# ---------------------------------------------------------------------------------------
# Robust names percent-encode every character that could leave the directory or that a
# filesystem refuses; everything else (including non-ASCII) is kept as is.
_ENCODED_CHARACTERS = frozenset('/<>:"|?*\\ %\x7f') | frozenset(chr(c) for c in range(0x20))
_SPECIAL_NAMES = {"": "%", ".": "%2E", "..": "%2E%2E"}
_NEEDS_ENCODING = re.compile("[" + re.escape("".join(sorted(_ENCODED_CHARACTERS))) + "]")


def encode_key(key: str) -> str:
    """The robust file-system name of one key part (tensordict's encoding).

    Examples:
        >>> encode_key("a/b% c")
        'a%2Fb%25%20c'
        >>> encode_key("..")
        '%2E%2E'
    """
    if key in _SPECIAL_NAMES:
        return _SPECIAL_NAMES[key]
    if _NEEDS_ENCODING.search(key) is None:  # the common case, checked at C speed
        return key
    return "".join(f"%{ord(c):02X}" if c in _ENCODED_CHARACTERS else c for c in key)


def decode_key(name: str) -> str:
    """The inverse of ``encode_key`` (a malformed ``%`` is kept as it is)."""
    if name == "%":
        return ""
    out, i = [], 0
    while i < len(name):
        hex_digits = name[i + 1 : i + 3]
        if name[i] == "%" and len(hex_digits) == 2 and all(c in "0123456789abcdefABCDEF" for c in hex_digits):
            out.append(chr(int(hex_digits, 16)))
            i += 3
        else:
            out.append(name[i])
            i += 1
    return "".join(out)


# What cannot appear in one file name on this system.  POSIX forbids only the separator
# and NUL; Windows also refuses its second separator, drive/stream colons, the wildcard
# and redirection characters and control characters.
if os.name == "nt":  # pragma: no cover - the tests run on Linux
    _NOT_IN_A_NAME = frozenset('/\\<>:"|?*') | frozenset(chr(c) for c in range(0x20))
else:
    _NOT_IN_A_NAME = frozenset("/\x00")


def is_safe_legacy_name(key: str, *, directory: bool = False) -> bool:
    """True if ``key`` used verbatim is one file name on this system, inside its directory.

    Legacy (``robust_key=False``) layouts use raw keys as names; only such keys are
    followed when loading, and only such keys may be written in legacy mode.  On Linux
    that refuses only '/' and NUL, and '', '.', '..' as directories (a leaf's name gets
    '.memmap' appended, so ``"."`` is the file ``..memmap``); ``"x:y"`` or ``"a\\b"`` are
    plain names, written as they are, as tensordict 0.15.3 does.

    Examples:
        >>> is_safe_legacy_name("x:y"), is_safe_legacy_name("a/b"), is_safe_legacy_name("..")
        (True, False, True)
        >>> is_safe_legacy_name("..", directory=True)
        False
    """
    if not _NOT_IN_A_NAME.isdisjoint(key):
        return False
    return not (directory and key in ("", ".", ".."))
