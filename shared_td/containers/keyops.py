"""Key-level operations of a TensorDict: select, exclude, flatten_keys, unflatten_keys.

They build new tensordicts that share the entries (no tensor is copied).
"""
from __future__ import annotations

from typing import Any

from shared_td.containers.base import NO_DEFAULT, is_leaf_nontensor
from shared_td.keys import NestedKey, unravel_key


class KeyOps:
    """Mixin of TensorDict (it relies on ``_tensordict``, ``empty`` and ``_empty_child``)."""

    def select(self, *keys: NestedKey, inplace: bool = False, strict: bool = True,
               as_tensordict: bool = False) -> "KeyOps":
        """A tensordict with only ``keys`` (nested keys select inside nested tensordicts).
        ``as_tensordict`` (a tensorclass's option) is accepted and ignored, as in tensordict."""
        out = self.empty()
        for key in keys:
            path = unravel_key(key)
            value = self._get_path(path, NO_DEFAULT)
            if value is NO_DEFAULT:
                if strict:
                    raise KeyError(self._missing_key_message(path))
                continue
            node = out
            for i, part in enumerate(path[:-1]):
                child = node._tensordict.get(part)
                if child is None:
                    source = self._get_path(path[: i + 1], None)
                    child = source.empty() if isinstance(source, type(self)) else node._empty_child()
                    node._tensordict[part] = child
                node = child
            node._tensordict[path[-1]] = value
        if inplace:
            # Name a key that goes (or the first one, replaced by its selected part).
            removed = [k for k in self._tensordict if k not in out._tensordict] or list(self._tensordict)
            if removed:
                self._check_unlocked((removed[0],), "remove")
            self._tensordict = out._tensordict
            return self
        return out

    def exclude(self, *keys: NestedKey, inplace: bool = False) -> "KeyOps":
        """A tensordict without ``keys`` (missing keys are ignored)."""
        out = self if inplace else self.clone(recurse=False)
        if inplace and keys:
            self._check_unlocked(unravel_key(keys[0]), "remove")
        for key in keys:
            path = unravel_key(key)
            parent = out
            for part in path[:-1]:
                child = parent._tensordict.get(part)
                if not isinstance(child, type(self)):
                    parent = None
                    break
                if not inplace:
                    child = child.clone(recurse=False)
                    parent._tensordict[part] = child
                parent = child
            if parent is not None:
                parent._tensordict.pop(path[-1], None)
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
        out._last_op = keys_write_back(self, "flatten_keys", separator)
        return out

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
            out.set(path, value)
        if inplace:
            self._check_unlocked((), "unflatten its keys")
            self._tensordict = out._tensordict
            return self
        out._last_op = keys_write_back(self, "unflatten_keys", separator)
        return out


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


def keys_write_back(source: "KeyOps", method: str, separator: str) -> tuple:
    """The ``_last_op`` of what ``source.flatten_keys(separator)`` (or ``unflatten_keys``)
    returns: leaving ``with source.flatten_keys(",") as flat:`` writes ``flat``'s
    entries back into ``source`` (``update`` of the inverse op's result), as tensordict
    0.15.3 does, so the keys added or replaced in the block reach ``source``; a locked
    ``source`` is left as it is. (Removed keys are not removed from ``source``.)

    Example:
        >>> td = TensorDict(batch_size=[2])
        >>> with td.flatten_keys(",") as flat:
        ...     flat["a,b"] = torch.zeros(2)
        >>> td["a", "b"].shape
        torch.Size([2])
    """
    inverse = "unflatten_keys" if method == "flatten_keys" else "flatten_keys"

    def write_back(result: "KeyOps") -> None:
        if not source.is_locked:
            source.update(getattr(result, inverse)(separator))

    return ("write_back", write_back)
