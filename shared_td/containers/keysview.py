"""The object returned by ``td.keys()``: iterable, sized, and ``in`` understands nested keys."""
from __future__ import annotations

import functools
from typing import Any, Iterator

from shared_td.containers.value_kinds import default_is_leaf, is_lazy_stack, is_non_tensor_class, is_tensor_collection
from shared_td.keys import RAISE, is_nested_key, unravel_key
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


#: what KeysView.pairs gives for a value that only ``get(key)`` can give
UNSEEN = object()
#: what a lookup of a key that is not there reads
_MISSING = object()


@functools.lru_cache(maxsize=4096)
def _peeks(cls: type) -> bool:
    """Whether instances of ``cls`` are lazy stacks, read by peeking at their members.
    Asked once per class, not once per node of every walk (``hasattr`` of a missing
    name raises and catches an AttributeError: an eighth of a walk of a 1000-node tree)."""
    return hasattr(cls, "_peek_str")


def peek_path(td: Any, path: tuple) -> Any:
    """The entry at ``path`` of ``td`` read without stacking anything (None when it is
    not there): a lazy stack on the way is peeked at (its first member's leaf, a lazy
    stack of its members' nested nodes), since reading a ragged leaf of one raises. For
    ``key in td`` and what only needs to know an entry's kind."""
    node = td
    for part in path:
        read = _reader(type(node))
        if read is _INNER:  # a tensorclass: its tensordict
            node = node._tensordict
            read = _reader(type(node))
        if read is None:  # (a tensor or value on the way)
            return None
        node = getattr(node, read)(part, None)
        if node is None:
            return None
    return node


def tensors_at(node: Any, path: tuple) -> Iterator[Any]:
    """The tensors that hold ``node``'s entry at ``path`` (every tensor of a collection
    there), read node by node: through a lazy stack, in each member (its ``get`` gives a
    stacked copy). A KeyError when ``path`` is missing or runs through a tensor."""
    node = unwrap_tensorclass(node)
    if is_lazy_stack(node):
        for member in node.tensordicts:
            yield from tensors_at(member, path)
    elif not path:
        yield from node._leaf_tensors() if is_tensor_collection(node) else [node]
    elif not is_tensor_collection(node):
        raise KeyError(path)
    else:
        yield from tensors_at(node.get(path[:1], RAISE), path[1:])


_INNER = object()


@functools.lru_cache(maxsize=4096)
def _reader(cls: type) -> Any:
    """The name of the method :func:`peek_path` reads an entry of an instance of ``cls``
    with (asked once per class; the name, not the function, so that a method replaced
    later is the one called): a lazy stack's ``_peek_str``, a tensordict's ``_get_str``;
    ``_INNER`` for a tensorclass, None for what holds no entry."""
    if is_tensorclass(cls):
        return _INNER
    return "_peek_str" if hasattr(cls, "_peek_str") else "_get_str" if hasattr(cls, "_get_str") else None


def _peeked(lazy: Any, key: str, default: Any) -> Any:
    """A lazy stack's entry ``key`` as its walk sees it: ``_peek_str``'s, but a lazy stack
    of members that were all given as one tensorclass is that tensorclass over it (as
    ``get`` gives it), so that ``is_leaf`` is asked about that class, as for a tensordict.
    The wrapper is built as a stored one (``_stored=True``): a key listing must not run
    the class's ``__post_init__`` (which may write into the members, or raise on a locked
    stack) nor a frozen class's lock."""
    value = lazy._peek_str(key, default)
    cls = value._one_tensorclass() if value is not default and is_lazy_stack(value) else None
    return value if cls is None else cls._from_tensordict(value, _stored=True)


def _sort_name(key: Any) -> str:
    """What ``sort=True`` orders a key by: its parts joined by ".", as tensordict 0.15.3
    does (``("a", "c")`` sorts as ``"a.c"``: after ``"a-b"``, where ordering the tuples
    would put it first); keys with the same name keep the walk's order."""
    return key if isinstance(key, str) else ".".join(key)


def _pair_sort_name(pair: tuple) -> str:
    return _sort_name(pair[0])


class KeysView:
    """A live view of the keys of a tensordict.

    Examples:
        >>> td = TensorDict(a=torch.zeros(()), b={"c": torch.zeros(())})
        >>> ("b", "c") in td.keys(include_nested=True)
        True
    """

    def __init__(self, td: Any, include_nested: bool, leaves_only: bool, sort: bool, is_leaf=None):
        self._td = td
        self._is_leaf = is_leaf
        self._include_nested = include_nested
        self._leaves_only = leaves_only
        self._sort = sort

    def __iter__(self) -> Iterator:
        if not self._include_nested and not self._leaves_only and not self._sort:
            return self._td._keys_str()  # every key is listed: no value is looked at
        return iter(self._listed())

    def pairs(self) -> Iterator[tuple]:
        """``(key, value)`` in the order of values() and items(), the value as the walk
        found it, or UNSEEN where only ``get(key)`` gives it (below a lazy stack, whose
        walk peeks at its members): they need no second walk from the root per key.
        tensordict 0.15.3 lists a nested tensordict before its keys there (and after
        them in keys(), see :meth:`_collect`)."""
        pairs = self._walk(self._td, (), True, {})
        if self._sort:
            pairs = iter(sorted(pairs, key=_pair_sort_name))
        return pairs

    def _kind(self, cls: type, kinds: dict) -> tuple[bool, bool, bool]:
        """Whether a value of type ``cls`` is listed, whether the walk goes into it, and
        whether it is a tensorclass (the walk goes into its tensordict); kept in
        ``kinds`` for the rest of one walk (``is_leaf`` is given the type only, and a
        1000-node tree has two types: asking per value was most of its walk)."""
        leaf = bool((self._is_leaf or default_is_leaf)(cls))
        # a tensor collection (what default_is_leaf is not) other than a non-tensor
        # container, which has no keys to walk into
        walked = not leaf and self._include_nested and not default_is_leaf(cls) and not is_non_tensor_class(cls)
        kinds[cls] = kind = (leaf or not self._leaves_only, walked, is_tensorclass(cls))
        return kind

    @staticmethod
    def _entries(td: Any, exact: bool) -> tuple[Iterator[tuple[str, Any]], bool]:
        """``(key, value)`` of node ``td``, and whether the values are what ``get`` gives:
        a lazy stack peeks at its members instead of stacking every value, so what its
        walk finds (and all below it) is not."""
        if not _peeks(type(td)):
            return td._items_str(), exact
        return ((key, _peeked(td, key, None)) for key in td._keys_str()), False

    def _walk(self, td: Any, prefix: tuple, exact: bool, kinds: dict) -> Iterator:
        entries, exact = self._entries(td, exact)
        for key, value in entries:
            listed, walked, wrapped = kinds.get(type(value)) or self._kind(type(value), kinds)
            if listed:
                yield (prefix + (key,) if prefix else key), (value if exact else UNSEEN)
            if walked:
                yield from self._walk(value._tensordict if wrapped else value, prefix + (key,), exact, kinds)

    def _listed(self) -> list:
        """The keys :meth:`__iter__` gives, made at once into a list: appending from one
        recursion costs less than yielding each key up through a generator per level
        (``list(td.keys(True, True))`` of a 1000-node tree was 1.5x tensordict's)."""
        listed: list = []
        self._collect(self._entries(self._td, True)[0], (), {}, listed)
        if self._sort:
            listed.sort(key=_sort_name)
        return listed

    def _listing_kind(self, cls: type, kinds: dict) -> tuple[bool, int]:
        """:meth:`_kind` for the listing walks: whether a value of type ``cls`` is listed,
        and how the walk goes into it: ``0`` not at all, ``1`` through its own
        ``_items_str()`` (a plain tensordict: most nodes, with no call per node to find
        out), ``2`` through :meth:`_node_entries`."""
        listed, walked, wrapped = self._kind(cls, {})
        kinds[cls] = kind = (listed, 0 if not walked else 2 if wrapped or _peeks(cls) else 1)
        return kind

    def _node_entries(self, value: Any) -> Iterator[tuple[str, Any]]:
        """The entries of a node that is a tensorclass or a lazy stack."""
        return self._entries(value._tensordict if is_tensorclass(type(value)) else value, True)[0]

    def _collect(self, entries: Iterator[tuple[str, Any]], prefix: tuple, kinds: dict, listed: list) -> None:
        """Append the keys of ``entries`` (those of one node) and below to ``listed``, a
        nested tensordict's after its entries (tensordict 0.15.3's order in keys())."""
        kind_of, append = kinds.get, listed.append  # (bound once per node, not per entry)
        for key, value in entries:
            kind = kind_of(type(value)) or self._listing_kind(type(value), kinds)
            if kind[1]:
                nested = prefix + (key,)
                self._collect(value._items_str() if kind[1] == 1 else self._node_entries(value), nested, kinds,
                              listed)
                if kind[0]:
                    append(nested if prefix else key)
            elif kind[0]:
                append(prefix + (key,) if prefix else key)

    def _count(self, entries: Iterator[tuple[str, Any]], kinds: dict) -> int:
        """How many keys :meth:`_collect` lists from ``entries``, without making them:
        ``list()`` asks ``len()`` before it iterates (a count costs half a listing)."""
        kind_of, count = kinds.get, 0
        for _key, value in entries:
            kind = kind_of(type(value)) or self._listing_kind(type(value), kinds)
            count += kind[0]
            if kind[1]:
                count += self._count(value._items_str() if kind[1] == 1 else self._node_entries(value), kinds)
        return count

    def __len__(self) -> int:
        if not self._include_nested and not self._leaves_only:
            return sum(1 for _key in self._td._keys_str())  # every key is listed
        return self._count(self._entries(self._td, True)[0], {})

    def __contains__(self, key: Any) -> bool:
        """One lookup along ``key``'s path (not a walk of the tree): each node on the way
        one the walk goes into, the entry itself one it lists."""
        if not is_nested_key(key):
            return False
        path = unravel_key(key)
        if len(path) > 1 and not self._include_nested:
            return False
        kinds, node = {}, self._td
        for depth, part in enumerate(path):
            read = _reader(type(node))
            value = _peeked(node, part, _MISSING) if read == "_peek_str" else getattr(node, read)(part, _MISSING)
            if value is _MISSING:
                return False
            listed, walked, wrapped = kinds.get(type(value)) or self._kind(type(value), kinds)
            if depth == len(path) - 1:
                return listed
            if not walked:
                return False
            node = value._tensordict if wrapped else value
        return False

    def __repr__(self) -> str:
        return f"_TensorDictKeysView({list(self)}, include_nested={self._include_nested}, leaves_only={self._leaves_only})"
