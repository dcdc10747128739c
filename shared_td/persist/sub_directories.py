"""What :meth:`NodeKind.child_names <shared_td.persist.nodes.NodeKind.child_names>` looks
at in one node directory, for a caller that reads the save through its own lookups (the
survey behind ``shared-td verify``) rather than a ``Directory``: whether a sub-directory
is there, and every name the node holds (None: it cannot be listed).

The names let a kind find what lies beyond a missing fixed-name child: a lazy stack saved
without a member count (as tensordict saves one) that lost members 1 and 2 of 0..3 has a
member 3, which looking one index ahead would miss (a stack of 1, no error).
"""
from __future__ import annotations

from typing import Callable, Iterable


class SubDirectories:
    """``is_directory`` for ``child_names``: call it with a name; ``names()`` lists the
    node's entries (what ``os.listdir`` of the node directory gives, or more), or is
    None where the node cannot be listed (then only the next index is looked at).

    Example:
        >>> found = SubDirectories({"0", "3"}.__contains__, lambda: ["0", "3", "meta.json"])
        >>> found("3"), found("1"), sorted(found.names())
        (True, False, ['0', '3', 'meta.json'])
    """

    __slots__ = ("_is_directory", "names")

    def __init__(self, is_directory: Callable[[str], bool], names: Callable[[], Iterable[str]]):
        self._is_directory = is_directory
        self.names = names

    def __call__(self, name: str) -> bool:
        return self._is_directory(name)
