"""Locking of tensordicts: lock_, unlock_, is_locked, and ``with td.lock_()/unlock_()``.

A locked tensordict refuses to add, remove or replace an entry (in-place writes stay
allowed); the lock reaches every nested tensordict, which remembers its locked parents
so that it cannot be unlocked on its own.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from shared_td.errors import LockedTensorDictError
from shared_td.keys import key_repr
from shared_td.tensorclass_protocol import unwrap_tensorclass


def lock_built(node: "LockingOps", children: list) -> None:
    """Lock ``node``, a tensordict just built over ``children`` (its collection children,
    each already locked): what lock_() does, without looking the children up again
    (consolidate() of a 1000-node tree spent most of its time there)."""
    node._is_locked = True
    for child in children:
        child._lock_parents[id(node)] = weakref.ref(node)
    node._last_op = "lock_"


# id(node) -> (weakref to the node, the token of the last lock_until_restored that
# locked it; see there). Kept outside the node, whose __dict__ is its pickled state.
# An entry whose node is gone is ignored (its id may be another node's now) and
# dropped when the table has doubled since it was last pruned.
_lock_tokens: dict[int, tuple[weakref.ref, object]] = {}
_tokens_guard = threading.Lock()
_prune_at = 1024


def _new_guard_in_child() -> None:
    global _tokens_guard
    _tokens_guard = threading.Lock()  # (a thread of the parent may have held it at the fork)


os.register_at_fork(after_in_child=_new_guard_in_child)


def _token_of(node: Any) -> object:
    entry = _lock_tokens.get(id(node))
    return entry[1] if entry is not None and entry[0]() is node else None


def _mark(node: Any, token: object) -> None:
    """Call with ``_tokens_guard`` held."""
    global _prune_at
    _lock_tokens[id(node)] = (weakref.ref(node), token)
    if len(_lock_tokens) > _prune_at:
        for key in [key for key, (ref, _) in _lock_tokens.items() if ref() is None]:
            del _lock_tokens[key]
        _prune_at = max(1024, 2 * len(_lock_tokens))


def lock_until_restored(obj: Any, restorers: list) -> None:
    """Lock ``obj`` (a tensordict or tensorclass) and every nested tensordict, as
    ``lock_()`` does, having first appended to ``restorers`` what puts each one's lock
    back as it was: its flag and its locked parents (an unlocked tree may hold a
    tensordict locked on its own, which must stay locked). Given before any node is
    locked, not returned: a Ctrl-C landing as this call returned left the tree locked,
    the restore lost with the result. For a write running in the background (memmap_,
    consolidate with ``return_early``) that must find the entries as it left them, and
    undo the lock if it fails. One walk that saves and locks each node (a node held
    twice is saved once; the restore is a no-op for a node that a later call locked
    again)."""
    saved, seen = [], set()
    # Each call marks the nodes with a token of its own: restore() puts back only the
    # nodes that still carry it. A later write of the same nodes (which locked them
    # again, with its own token) finished since would otherwise be undone by an earlier
    # write that fails after it (its "unlocked" would unlock a completed memmap_).
    token = object()
    pending = [(unwrap_tensorclass(obj), None)]

    def restore() -> None:
        with _tokens_guard:
            for node, locked, parents, last_op, earlier in saved:
                if _token_of(node) is not token:
                    continue  # a later write locked it again: its state is that write's
                node._is_locked, node._last_op = locked, last_op
                _mark(node, earlier)
                node._lock_parents.clear()
                node._lock_parents.update(parents)

    restorers.append(restore)
    with _tokens_guard:
        while pending:
            node, parent = pending.pop()
            if id(node) not in seen:
                seen.add(id(node))
                saved.append((node, node._is_locked, dict(node._lock_parents), getattr(node, "_last_op", None),
                              _token_of(node)))
                _mark(node, token)  # (first: a Ctrl-C landing in it leaves the node as it was)
                node._is_locked = True
                node._last_op = "lock_"
                pending.extend((unwrap_tensorclass(child), node) for child in node._collection_children())
            if parent is not None:
                node._lock_parents[id(parent)] = weakref.ref(parent)


class LockingOps:
    """Mixin of TensorDictBase (it relies on ``_keys_str``, ``_get_str``, ``_is_locked``,
    ``_lock_parents`` and ``_context_ops``)."""

    @property
    def is_locked(self) -> bool:
        """True if entries cannot be added, removed or replaced (see lock_())."""
        return self._is_locked

    @is_locked.setter
    def is_locked(self, value: bool) -> None:
        self.lock_() if value else self.unlock_()

    def _check_unlocked(self, path: tuple[str, ...], action: str) -> None:
        if self._is_locked:
            target = f" key {key_repr(path)}" if path else ""  # () for whole-tensordict ops
            raise LockedTensorDictError(  # (its first sentence is tensordict's: handlers match it)
                "Cannot modify locked TensorDict. For in-place modification, consider using "
                f"the `set_()` method and make sure the key is present. (Here: cannot {action}"
                f"{target}; update_() writes in place too, or unlock it first with "
                "`with td.unlock_(): ...`.)"
            )

    def _collection_children(self) -> list:
        children = []
        for key in self._keys_str():
            value = unwrap_tensorclass(self._get_str(key, None))
            if isinstance(value, LockingOps):  # a tensordict of any class
                children.append(value)
        return children

    def lock_(self) -> "LockingOps":
        """Lock self and every nested tensordict: entries can then only be written in place.

        Usable as a context manager: ``with td.lock_(): ...`` unlocks at exit a
        tensordict that was unlocked before (one already locked stays locked).
        """
        was_locked = self.is_locked
        self._is_locked = True
        for child in self._collection_children():
            child._lock_parents[id(self)] = weakref.ref(self)
            child.lock_()
        # as tensordict: the ``with`` block undoes only a change of state
        self._last_op = None if was_locked else "lock_"
        return self

    def unlock_(self) -> "LockingOps":
        """Unlock self and every nested tensordict; ``is_memmap()`` and ``is_shared()``
        become False.

        Usable as a context manager: ``with td.unlock_(): ...`` re-locks at exit a
        tensordict that was locked before (one already unlocked stays unlocked).

        Raises:
            RuntimeError: if self is nested in a tensordict that is still locked.
        """
        if self._locked_parent() is not None:
            raise RuntimeError(
                "Cannot unlock a tensordict that is part of a locked graph: unlock the "
                "parent tensordict it belongs to instead."
            )
        other_root = self._locked_holder_outside()
        if other_root is not None:
            raise RuntimeError(
                "Cannot unlock a tensordict that is part of a locked graph: a tensordict "
                "nested in it is also held by another locked tensordict (keys "
                f"{sorted(map(str, other_root.keys()))}). Drop that tensordict, or unlock both "
                "through a tensordict that holds them."
            )
        was_locked = self.is_locked
        self._unlock_tree()
        self._last_op = "unlock_" if was_locked else None
        return self

    def _locked_parent(self, ignore: int | None = None) -> "LockingOps | None":
        """A locked tensordict that self is nested in, other than the one of id
        ``ignore``; None if there is none."""
        for parent_id, ref in self._lock_parents.items():
            parent = ref()
            if parent_id != ignore and parent is not None and parent._is_locked:
                return parent
        return None

    def _locked_holder_outside(self) -> "LockingOps | None":
        """A locked tensordict outside self's tree that holds one of the tensordicts
        nested in self (``other = TensorDict(a=td["a"]).lock_()``): unlocking self would
        unlock that entry of ``other`` too, as tensordict refuses to. None if none."""
        inside, pending, nested = {id(self)}, [self], []
        while pending:
            for child in pending.pop()._collection_children():
                if id(child) not in inside:
                    inside.add(id(child))
                    nested.append(child)
                    pending.append(child)
        for node in nested:
            for parent_id, ref in node._lock_parents.items():
                parent = ref()
                if parent_id not in inside and parent is not None and parent._is_locked:
                    return parent
        return None

    def _unlock_tree(self) -> None:
        self._is_locked = False
        self._is_memmap = False
        self._is_shared = False
        for child in self._collection_children():
            child._lock_parents.pop(id(self), None)
            child._unlock_tree()

    def __enter__(self) -> "LockingOps":
        self._context_ops.append(getattr(self, "_last_op", None))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        op = self._context_ops.pop()
        if op == "unlock_":
            self.lock_()
        elif op == "lock_":
            self.unlock_()
        elif isinstance(op, tuple) and op[0] == "write_back" and exc_type is None:  # (shape_write_back.with_write_back;
            op[1](self)  # a block that raised writes nothing back, as in tensordict)
