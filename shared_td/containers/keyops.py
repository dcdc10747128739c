"""Key-level operations of a TensorDict: select, exclude, flatten_keys, unflatten_keys.

They build new tensordicts that share the entries (no tensor is copied).
"""
from __future__ import annotations

from typing import Any

from shared_td.containers.base import is_leaf_nontensor, is_tensor_collection
from shared_td.containers.lazy_writes import _is_branch, _is_lazy
from shared_td.containers.shape_write_back import with_write_back
from shared_td.keys import NestedKey, is_below, key_repr, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass


class KeyOps:
    """Mixin of TensorDict (it relies on ``_tensordict``, ``empty`` and ``_empty_child``)."""

    def select(self, *keys: NestedKey, inplace: bool = False, strict: bool = True,
               as_tensordict: bool = False) -> "KeyOps":
        """A tensordict with only ``keys``, sharing the entries (no tensor is copied).
        ``as_tensordict`` (a tensorclass's option) is accepted and ignored, as in tensordict.

        A nested key is selected by the nested collection's own ``select``, so a lazy
        stack gives a lazy stack of its members' selections (sharing their tensors,
        members of different shapes too) and a tensorclass an instance of its class.

        Example:
            >>> td = TensorDict(a=torch.zeros(2), n={"b": torch.ones(2), "c": torch.ones(2)}, batch_size=[2])
            >>> out = td.select(("n", "b"))
            >>> list(out.keys(True, True)), out["n", "b"] is td["n", "b"]
            ([('n', 'b')], True)
        """
        out = self.empty()
        for part, rests in _by_first_part(self, keys, strict, whole_wins=False).items():
            entry = self._tensordict[part]
            out._tensordict[part] = entry if rests is None else entry.select(*rests, strict=strict)
        if inplace:
            # Name a key that goes (or the first one, replaced by its selected part).
            removed = [k for k in self._tensordict if k not in out._tensordict] or list(self._tensordict)
            if removed:
                self._check_unlocked((removed[0],), "remove")
            self._tensordict = out._tensordict
            return self
        return out

    def exclude(self, *keys: NestedKey, inplace: bool = False) -> "KeyOps":
        """A tensordict without ``keys`` (missing keys are ignored).

        A nested key is removed by the nested collection's own ``exclude`` (a lazy
        stack's from each member, a tensorclass's keeping its class), whatever the
        classes of self and of its nested tensordicts.

        Example:
            >>> td = TensorDict(a=torch.zeros(2), n={"b": torch.ones(2), "c": torch.ones(2)}, batch_size=[2])
            >>> list(td.exclude(("n", "b")).keys(True, True))
            ['a', ('n', 'c')]
        """
        groups = _by_first_part(self, keys, strict=False, whole_wins=True)
        if inplace and groups:  # (a locked tensordict excludes missing keys, as tensordict 0.15.3)
            part, rests = next(iter(groups.items()))
            self._check_unlocked((part,) if rests is None else (part, *rests[0]), "remove")
        out = self if inplace else self.clone(recurse=False)  # (its nested collections are new ones)
        for part, rests in groups.items():
            if rests is None:
                out._tensordict.pop(part)
            else:  # (in place: out's entry is self's, or a copy of it made above)
                out._tensordict[part].exclude(*rests, inplace=True)
        return out

    def flatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Any = None) -> "KeyOps":
        """Nested entries as top-level keys joined by ``separator`` (``("a", "b")`` -> ``"a.b"``).

        ``is_leaf`` (as tensordict's: called with a class) tells which values are kept
        whole under their joined key; by default tensors and non-tensor entries
        (:func:`is_leaf_nontensor`); the others are flattened, or left out if they are
        not tensordicts.

        Example:
            >>> td = TensorDict(a=torch.zeros(2), n={"b": {"c": torch.ones(2)}}, batch_size=[2])
            >>> list(td.flatten_keys().keys()), list(td.flatten_keys("/", is_leaf=lambda cls: True).keys())
            (['a', 'n.b.c'], ['a', 'n'])
        """
        entries = {}
        for key in self.keys(True, True, is_leaf_nontensor if is_leaf is None else is_leaf):
            name = key if isinstance(key, str) else separator.join(key)
            if name in entries:
                raise KeyError(f"Flattening keys in tensordict causes keys to collide: {name!r} twice; "
                               "choose another separator.")
            entries[name] = self.get(key)
        if inplace:
            self._check_unlocked((), "flatten its keys")
            self._tensordict = entries
            return self
        out = type(self)._new_unsafe(entries, self._batch_size, self._device, self.names)
        # leaving `with td.flatten_keys() as flat:` writes flat's entries back into td
        return with_write_back(self, out, lambda result: result.unflatten_keys(separator))

    def unflatten_keys(self, separator: str = ".", inplace: bool = False) -> "KeyOps":
        """The inverse of ``flatten_keys``: ``"a.b"`` becomes ``("a", "b")``.

        Raises:
            KeyError: if two keys give one entry, or an entry below another one
                (``"a.b"`` beside ``"a"`` holding ``"b"``), as tensordict 0.15.3 raises.
        """
        out = self.empty()
        for key, value in self._tensordict.items():
            path = tuple(key.split(separator))
            if _taken(out, path):
                raise KeyError(
                    "Unflattening key(s) in tensordict will override an existing for unflattened key "
                    f"{path!r} (from {key!r}); choose another separator."
                )
            if is_tensor_collection(value):
                # a new one holding the same tensors (values), as tensordict's: self's own
                # would get the keys unflattened into it, the result's lock and its
                # non-tensor writes (keys added to the result's "n" were added to self's)
                value = value.clone(recurse=False)
            out.set(path, value)
        if inplace:
            self._check_unlocked((), "unflatten its keys")
            self._tensordict = out._tensordict
            return self
        return with_write_back(self, out, lambda result: result.flatten_keys(separator))


def _by_first_part(td: "KeyOps", keys: tuple, strict: bool, whole_wins: bool) -> dict:
    """``keys`` of ``td`` grouped by their first part: ``{part: None}`` for the whole
    entry, ``{part: [rest, ...]}`` for keys inside the nested collection at ``part``,
    in the order of the keys.

    When a whole entry and keys inside it are both named, ``whole_wins`` picks: exclude
    removes the whole entry, select keeps only the keys inside it (the more specific
    key wins, whatever the order, as tensordict 0.15.3's ``select("b", ("b", "a"))``).

    A key that ``td`` lacks raises (a KeyError naming it) when ``strict``, and is
    skipped otherwise, but for select the nested collections on its way are kept, emptied
    (``select(("b", "zz"), strict=False)`` gives ``{"b": {}}``, as tensordict 0.15.3); a
    lazy stack on the way checks the rest of the key itself (each member)."""
    groups: dict = {}
    for key in keys:
        path = unravel_key(key)
        if not _holds(td, path):
            if strict:
                raise KeyError(td._missing_key_message(path))
            if whole_wins or len(path) == 1 or not _is_branch(td._get_str(path[0], None)):
                continue
            # select keeps the nested collection on the way, emptied (its own select
            # skips the rest), as tensordict 0.15.3's select(strict=False)
        rests = groups.get(path[0], ())
        if len(path) == 1:
            groups[path[0]] = None if whole_wins or not rests else rests
        elif rests is not None or not whole_wins:
            groups[path[0]] = [*(rests or ()), path[1:]]
    return groups


def _holds(node: Any, path: tuple) -> bool:
    """Whether ``node`` holds ``path``, read node by node without stacking anything:
    a lazy stack on the way is taken to hold the rest (it checks it, member by member)."""
    for part in path:
        if _is_lazy(node):
            return True
        node = unwrap_tensorclass(node)._get_str(part, None) if _is_branch(node) else None
        if node is None:
            return False
    return True


def renamed_in_members(td: Any, old: tuple, new: tuple, safe: bool) -> bool:
    """``td.rename_key_(old, new, safe)`` when a lazy stack holds both keys (``td``
    itself, or a node on their common path): done by each member on its own entry,
    which keeps sharing it (the stack's ``get`` gives a stacked copy, which raises when
    the members' shapes differ). A member stacked twice (``lazy_stack([m, m])``), here
    or in a nested stack, renames once. Returns False, doing nothing, when no lazy
    stack does.

    Raises:
        KeyError: if a member lacks ``old`` or, with ``safe``, holds ``new`` (as
            tensordict 0.15.3 names them). LockedTensorDictError: if a member's entry
            cannot be renamed. Both before the first member renames: all or nothing.

    Example:
        >>> m = TensorDict(a=torch.zeros(()))
        >>> _ = shared_td.lazy_stack([m, m]).rename_key_("a", "b")
        >>> list(m.keys())
        ['b']
    """
    node, depth = td, 0
    while not _is_lazy(node):
        if depth >= min(len(old), len(new)) - 1 or old[depth] != new[depth] or not _is_branch(node):
            return False
        node, depth = unwrap_tensorclass(node)._get_str(old[depth], None), depth + 1
    targets: dict = {}
    _rename_targets(node, old[depth:], new[depth:], targets)
    for member, inner_old, inner_new, stack in targets.values():  # every check before the first change
        if not _holds(member, inner_old):
            raise KeyError(td._missing_key_message(old))
        # (a member given as a tensorclass: a key that is no field is refused, as its own
        # rename_key_ and set refuse it)
        stack._refuse_new_key_no_field(member, inner_new[0])
        # the lock before the safe check, as a TensorDict's rename_key_ and tensordict
        _check_renamable(unwrap_tensorclass(member), inner_old, inner_new)
        if safe and inner_new != inner_old and not is_below(inner_new, inner_old) and _holds(member, inner_new):
            raise KeyError(f"Key {key_repr(new)} is already present in TensorDict; pass safe=False to replace it.")
    for member, inner_old, inner_new, _ in targets.values():
        member.rename_key_(inner_old, inner_new, safe)
    return True


def _rename_targets(node: Any, old: tuple, new: tuple, targets: dict) -> None:
    """Fill ``targets`` with ``{(id, old, new): (member, old, new, stack)}``: the members of
    lazy stack ``node`` that rename, each met once (a member stacked twice is one
    object: renaming it twice raised after the first), looking through the lazy stacks
    among them or on their part of the common path."""
    for member in node.tensordicts:
        inner, depth = member, 0
        while not _is_lazy(inner) and depth < min(len(old), len(new)) - 1 and old[depth] == new[depth]:
            inner = unwrap_tensorclass(inner)._get_str(old[depth], None) if _is_branch(inner) else None
            depth += 1
        if _is_lazy(inner):
            _rename_targets(inner, old[depth:], new[depth:], targets)
        else:  # (a missing key: the member is checked, and named, by the caller)
            targets.setdefault((id(member), old, new), (member, old, new, node))


def _check_renamable(member: Any, old: tuple, new: tuple) -> None:
    """Raise as ``member.rename_key_(old, new)`` would for a lock, without changing
    anything: ``old``'s tensordict must be unlocked (the entry leaves it), and so must
    the one ``new`` is written into (or the deepest existing one on its way, which
    gets the missing tensordicts)."""
    member._parent_for_write(old, create=False)._check_unlocked(old, "rename")
    if is_below(new, old):
        return  # (renamed below itself: old leaves first and its tensordict gets new's)
    parent, depth = member._deepest_existing_parent(new)
    parent._check_unlocked(new[: depth + 1], "rename")


def _taken(td: "KeyOps", path: tuple) -> bool:
    """Whether setting ``path`` in ``td`` would replace an entry, or go through a value
    that is not a tensordict."""
    node = td
    for i, part in enumerate(path):
        value = node._tensordict.get(part) if hasattr(node, "_tensordict") else None
        if value is None:
            return False
        if i == len(path) - 1 or not isinstance(value, type(td)):
            return True
        node = value
    return False
