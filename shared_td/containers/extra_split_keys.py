"""``split_keys``: a tensordict split into one tensordict per set of keys, plus one of
the entries no set took (tensordict 0.15.3's method; ExtraNameOps calls
:func:`split_keys`). The values are not copied: every part holds the same tensors.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from shared_td.containers.value_kinds import is_nested_node, is_non_tensor, is_tensor_collection
from shared_td.keys import is_below, key_repr, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass

#: split_keys's ``default`` when none is given
NO_DEFAULT = object()


def split_keys(td: Any, key_sets: tuple, *, inplace: bool, default: Any, strict: bool,
               reproduce_struct: bool) -> tuple:
    """The parts of the tensordict ``td`` (see ``ExtraNameOps.split_keys``).

    A set is a list of keys, a dict ``{key: new key}`` (the entry is renamed in its
    part) or a callable ``fn(key, value) -> bool`` called on every tensor leaf that no
    earlier set took (``key`` as a tuple; ``fn`` is not called on nested tensordicts or
    non-tensor entries). Each set takes from what the earlier ones left.

    Every set is read, and every missing key raises, before ``td`` changes: with
    ``inplace=True`` the taken entries are removed from ``td`` at the end only (as in
    tensordict, so a KeyError leaves it whole).
    """
    if strict:
        default = NO_DEFAULT  # (a missing key raises; default is ignored, as in tensordict)
    elif default is NO_DEFAULT:
        default = None  # (a missing key is skipped)
    for key_set in key_sets:
        if not _is_predicate(key_set):
            _refuse_nested_pairs(list(key_set))
    rest = td.copy()  # (a new tree over the same tensors: taking from it leaves td alone)
    parts, taken = [], []
    for key_set in key_sets:
        part = td.empty(recurse=reproduce_struct)
        if reproduce_struct:  # the tree of nested tensordicts, without td's non-tensor values
            _drop_non_tensors(part)
        if _is_predicate(key_set):
            chosen = key_set
            key_set = [key for key, value in rest.items(True, True)
                       if chosen(key if isinstance(key, tuple) else (key,), value)]
        if not isinstance(key_set, dict):
            key_set = {key: key for key in key_set}
        for key, new_key in key_set.items():
            value = rest.pop(key) if default is NO_DEFAULT else rest.pop(key, default)
            if value is not None:
                part.set(new_key, value)
            taken.append(key)
        parts.append(part)
    if inplace:
        target = unwrap_tensorclass(td)
        for key in taken:  # every removal checked before the first: a locked nested
            target._check_removable(unravel_key(key))  # tensordict lost the keys before it
        for key in taken:
            td.pop(key, None)
        rest = td
    if not reproduce_struct:
        drop_empty(rest)
    return (*parts, rest)


def _is_predicate(key_set: Any) -> bool:
    """A set given as ``fn(key, value) -> bool``, not as keys."""
    return callable(key_set) and not isinstance(key_set, Iterable)


def _refuse_nested_pairs(keys: list) -> None:
    """ValueError when a key of one set is inside another of it (``"k0"`` and ``("k0",
    "k1")``): taken in that order the second is missing, the other way round the part
    holds the outer entry without the inner one, lost from both (as in tensordict
    0.15.3). Checked before anything is taken. Keys sorted as tuples: one inside another
    comes right after it."""
    paths = sorted({unravel_key(key) for key in keys})
    for outer, inner in zip(paths, paths[1:]):
        if is_below(inner, outer):
            raise ValueError(f"split_keys/separates: {key_repr(outer)} and {key_repr(inner)} are both given, and "
                             f"the second is inside the first: give only {key_repr(outer)} (it holds the other), "
                             "or take them in two calls. Nothing was taken.")


def _drop_non_tensors(td: Any) -> None:
    """Remove every non-tensor entry of ``td``, at every depth (in place)."""
    for key, value in list(td.items()):
        if is_non_tensor(value):
            td.del_(key)
        elif is_tensor_collection(value):
            _drop_non_tensors(unwrap_tensorclass(value))


def drop_empty(td: Any) -> None:
    """Remove the nested tensordicts of ``td`` that hold no leaf, at every depth (in
    place; tensordict's ``filter_empty_``)."""
    for key, value in list(td.items()):
        if not is_nested_node(value):
            continue
        if value.is_empty():
            td.del_(key)
        else:
            drop_empty(unwrap_tensorclass(value))


def drop_emptied(td: Any, key: Any) -> None:
    """Remove the nested tensordicts on ``key``'s path in ``td`` that hold no leaf, the
    deepest first (after ``key`` was removed: what the removal left empty).

    Example:
        >>> td = TensorDict(a={"b": {"c": torch.zeros(())}}, e={})
        >>> del td["a", "b", "c"]; drop_emptied(td, ("a", "b", "c")); sorted(td.keys())
        ['e']
    """
    path = unravel_key(key)
    for depth in range(len(path) - 1, 0, -1):
        node = td.get(path[:depth], None)
        if not is_nested_node(node) or not node.is_empty():
            return
        td.del_(path[:depth])
