"""Key-level operations of a TensorDict: select, exclude, flatten_keys, unflatten_keys.

They build new tensordicts that share the entries (no tensor is copied).
"""
from __future__ import annotations

from shared_td.containers.base import NO_DEFAULT, is_leaf_nontensor
from shared_td.keys import NestedKey, unravel_key


class KeyOps:
    """Mixin of TensorDict (it relies on ``_tensordict``, ``empty`` and ``_empty_child``)."""

    def select(self, *keys: NestedKey, inplace: bool = False, strict: bool = True) -> "KeyOps":
        """A tensordict with only ``keys`` (nested keys select inside nested tensordicts)."""
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

    def flatten_keys(self, separator: str = ".", inplace: bool = False) -> "KeyOps":
        """Nested entries as top-level keys joined by ``separator`` (``("a", "b")`` -> ``"a.b"``)."""
        entries = {}
        for key in self.keys(True, True, is_leaf_nontensor):
            name = key if isinstance(key, str) else separator.join(key)
            if name in entries:
                raise KeyError(f"Flattening gives the key {name!r} twice; choose another separator.")
            entries[name] = self.get(key)
        if inplace:
            self._check_unlocked((), "flatten its keys")
            self._tensordict = entries
            return self
        return type(self)._new_unsafe(entries, self._batch_size, self._device, self.names)

    def unflatten_keys(self, separator: str = ".", inplace: bool = False) -> "KeyOps":
        """The inverse of ``flatten_keys``: ``"a.b"`` becomes ``("a", "b")``."""
        out = self.empty()
        for key, value in self._tensordict.items():
            out.set(tuple(key.split(separator)), value)
        if inplace:
            self._check_unlocked((), "unflatten its keys")
            self._tensordict = out._tensordict
            return self
        return out
