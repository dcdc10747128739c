"""Names of a lazy stack's batch dims, as a mixin of LazyStackedTensorDict (LazyNames).

A lazy stack has one name of its own, that of ``stack_dim`` (``stack_dim_name``, as in
tensordict 0.15.3); the names of its other dims are its members'. So ``names`` inserts
the one into the first member's, and setting names gives the one at ``stack_dim`` to the
stack and the others to every member. Operations that keep the stack dim (indexing along
it, ``unsqueeze``, ``permute``, ``clone``, ...) keep its name (``_restack``); a stack
rebuilt along a new dim (``reshape``) has none. memmap, save, ``consolidate(filename=)``
and pickling keep it, in tensordict's field ``stack_dim_name``.

This module does not import lazy.py (lazy.py imports it).
"""
from __future__ import annotations

from typing import Any, Sequence

from shared_td.containers import batch as batch_ops
from shared_td.containers.naming import NameClashError, NamedBatchDims, check_names


class LazyNames:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_stack_dim``,
    ``_member_batch``, ``batch_size`` and ``batch_dims``)."""

    # The name of the batch dim ``stack_dim``: a class default, so that a stack pickled
    # before it existed unpickles unnamed.
    _stack_dim_name: str | None = None
    # The names of the other dims of a stack without members (a member's otherwise),
    # which a named parent gives it: a class default, as _stack_dim_name.
    _empty_names: list | None = None

    @property
    def names(self) -> list | None:
        """The first member's dim names with the stack's own (``stack_dim_name``) at
        ``stack_dim``; None if no dim is named.

        Set them (``lazy.names = [...]``, or ``refine_names(...)``) and the name at
        ``stack_dim`` becomes the stack's, the others every member's, as in tensordict
        0.15.3 (unlike it, the names must be unique, as a TensorDict's); ``None``
        unnames every dim. Checked in every member before any is renamed.

        Example:
            >>> lazy = LazyStackedTensorDict(TensorDict(batch_size=[3]), TensorDict(batch_size=[3]))
            >>> lazy.names = ["time", "env"]
            >>> lazy.names, lazy.tensordicts[0].names
            (['time', 'env'], ['env'])
        """
        first = self.tensordicts[0].names if self.tensordicts else None
        for member in self.tensordicts[1:]:
            if member.names != first:
                raise ValueError(
                    f"Not all dim names match, got {first} and {member.names}: the members of "
                    "a lazy stack name their dims alike (as in tensordict). Name them all with "
                    "lazy.names = [...].")
        return self._names_of_first()

    def _names_of_first(self) -> list | None:
        """:attr:`names`, read from the first member alone."""
        member_names = self.tensordicts[0].names if self.tensordicts else self._empty_names
        if member_names is None and self._stack_dim_name is None:
            return None
        member_names = [None] * len(self._member_batch) if member_names is None else list(member_names)
        sd = self._stack_dim
        return member_names[:sd] + [self._stack_dim_name] + member_names[sd:]

    @names.setter
    def names(self, names: Sequence[str | None] | None) -> None:
        leading = [None] * self.batch_dims if names is None else check_names(names, self.batch_size)
        self._rename_leading(leading, check_only=True)
        self._rename_leading(leading, check_only=False)

    refine_names = NamedBatchDims.refine_names
    rename_ = NamedBatchDims.rename_
    rename = NamedBatchDims.rename

    def _rename_leading(self, leading: list, *, check_only: bool) -> None:
        """Give the first ``len(leading)`` batch dims these names: the one at
        ``stack_dim`` to the stack, the others to every member (NamedBatchDims's
        protocol: a parent names its children's leading dims so)."""
        if not leading:  # a parent without batch dims: nothing of ours is its
            return
        # (the first member's: names setting them all right is how members named
        # otherwise are mended)
        current = self._names_of_first() or [None] * self.batch_dims
        names = list(leading) + current[len(leading):]
        sd = self._stack_dim
        stack_dim_name, member_names = names[sd], names[:sd] + names[sd + 1:]
        if stack_dim_name is not None and (stack_dim_name in member_names or any(
                stack_dim_name in _inner_dim_names(m, len(member_names)) for m in self.tensordicts)):
            raise NameClashError(
                f"Cannot name the batch dims of this lazy stack {names}: {stack_dim_name!r}, "
                f"the name of its stack dim ({sd}), is used twice (the names asked for are "
                f"{list(leading)}, the stack's {self.names})."
            )
        for member in self.tensordicts:  # (each checks the names of its own dims)
            member._rename_leading(member_names, check_only=check_only)
        if not check_only:
            self._stack_dim_name = stack_dim_name
            if not self.tensordicts:  # (kept for the members it has none to give)
                self._empty_names = None if all(n is None for n in member_names) else member_names


def indexed_names(lazy: Any, out: Any, index: tuple) -> None:
    """Name ``out``, the new stack of views that ``lazy[index]`` gives for a mask, a bool
    or an N-D or several index tensors (``index`` normalized), as a TensorDict's dims are
    named after that index (``batch.indexed_names``: tensordict 0.15.3 names a lazy
    stack's result so too). Left unnamed when the members name their dims differently.

    Example:
        >>> members = [TensorDict(batch_size=[3], names=["env"]) for _ in range(2)]
        >>> lazy = LazyStackedTensorDict(*members, stack_dim_name="t")
        >>> lazy[True].names, lazy[[0, 1], [2, 0]].names
        ([None, 't', 'env'], None)
    """
    try:
        names = lazy.names
    except ValueError:  # members named otherwise: no one name per dim to carry
        return
    if names is not None:
        out.names = batch_ops.indexed_names(names, index)


def _inner_dim_names(td: Any, skip: int) -> set:
    """Names of the dims that tensordicts nested in ``td`` have after its ``skip`` batch
    dims (a nested lazy stack's read from its first member): a stack dim named so would
    give a nested entry of the stack that name twice."""
    names: set = set()
    for child in getattr(td, "_named_children", lambda: [])():
        if hasattr(child, "_names_of_first"):  # a lazy stack
            child_names = child._names_of_first() or []
        else:
            child_names = child.names or []
        names.update(n for n in child_names[skip:] if n is not None)
        names |= _inner_dim_names(child, skip)
    return names


def checked_stack_dim_name(name: Any, members: list) -> str:
    """``stack_dim_name``, refused (before the stack exists) if it is not a str or if the
    members name one of their dims so: dim names are unique, as a TensorDict's."""
    if not isinstance(name, str):
        raise TypeError(f"stack_dim_name must be a str (or None), got {name!r}.")
    member_names = members[0].names if members else None
    if member_names is not None and name in member_names:
        raise ValueError(
            f"stack_dim_name={name!r} is already the name of a batch dim of the members "
            f"(their names are {list(member_names)}): dim names must be unique. Choose "
            "another name, or rename the members' dim first."
        )
    return name


def names_members_agree_on(lazy: Any) -> list | None:
    """``lazy.names``, except that a dim its members name differently is unnamed (None)
    where ``names`` raises: what ``all(dim)``/``any(dim)`` keep, as tensordict 0.15.3
    gives such a dim no name there.

    Example:
        >>> import torch
        >>> from shared_td import LazyStackedTensorDict, TensorDict
        >>> lazy = LazyStackedTensorDict(
        ...     TensorDict({}, [3, 2], names=["x", "p"]),
        ...     TensorDict({}, [3, 2], names=["x", "q"]))
        >>> names_members_agree_on(lazy)
        [None, 'x', None]
    """
    every = [member.names for member in lazy.tensordicts]
    if all(names == every[0] for names in every):
        return lazy.names
    agreed = []
    for dim in range(len(lazy._member_batch)):
        seen = {None if names is None else names[dim] for names in every}
        agreed.append(seen.pop() if len(seen) == 1 else None)
    agreed.insert(lazy._stack_dim, lazy._stack_dim_name)
    return None if all(name is None for name in agreed) else agreed
