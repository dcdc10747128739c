"""Names of batch dims, shared with nested tensordicts (as tensordict 0.15.3 does).

A nested tensordict has the batch dims of its parent first, so it carries the parent's
names for them: naming the parent renames its nested tensordicts, and setting a nested
tensordict into a named one names the child's leading dims (an incompatible name there
is a RuntimeError, raised before anything changes).
"""
from __future__ import annotations

from typing import Any, Sequence

from shared_td.errors import NameClashError
from shared_td.tensorclass_protocol import unwrap_tensorclass


def check_names(names: Sequence[Any], batch_size) -> list:
    """``names`` as a list, checked against ``batch_size`` (TypeError/ValueError)."""
    names = list(names)
    wrong = [n for n in names if n is not None and not isinstance(n, str)]
    if wrong:
        raise TypeError(f"Names of batch dims are str or None, got {wrong[0]!r} in {names}.")
    if len(names) != len(batch_size):
        raise ValueError(
            f"Got {len(names)} names {names} for {len(batch_size)} batch dims "
            f"{list(batch_size)}: give one name (or None) per batch dim."
        )
    named = [n for n in names if n is not None]
    if len(set(named)) != len(named):
        raise ValueError(f"Names of batch dims must be unique, got {names}.")
    return names


def refined_names(current: Sequence[str | None] | None, batch_dims: int, names: Sequence[Any]) -> list:
    """The names ``refine_names(*names)`` gives batch dims now named ``current`` (None:
    none is named), checked (see :meth:`NamedBatchDims.refine_names`).

    Example:
        >>> refined_names(["env", None], 2, (..., "time")), refined_names(None, 2, ("a", None))
        (['env', 'time'], ['a', None])
    """
    # (the errors show the call as written)
    asked = ", ".join("..." if name is Ellipsis else repr(name) for name in names)
    names = list(names)
    current = list(current) if current is not None else [None] * batch_dims
    spread = [i for i, name in enumerate(names) if name is Ellipsis]
    if len(spread) > 1:
        raise ValueError(f"refine_names({asked}): at most one '...' can stand for the dims it covers.")
    if spread:
        covered = batch_dims - len(names) + 1
        if covered < 0:
            raise ValueError(
                f"refine_names({asked}): {len(names) - 1} names besides '...' for "
                f"{batch_dims} batch dims: give at most one name per batch dim.")
        at = spread[0]
        names = names[:at] + current[at:at + covered] + names[at + 1:]
    if len(names) != batch_dims:
        raise ValueError(
            f"refine_names({asked}): {len(names)} names for {batch_dims} batch dims: give "
            "one name (or None) per batch dim, or a '...' for those whose names stay.")
    for dim, (now, given) in enumerate(zip(current, names)):
        if now is not None and given != now:
            raise RuntimeError(
                f"refine_names({asked}): batch dim {dim} is named {now!r}, not {given!r}: "
                f"refine_names only names unnamed dims and checks the named ones (the names "
                f"are {current}). Give {now!r} (or '...') there, or rename with td.names = [...].")
    return names


def renamed(current: Sequence[str | None] | None, batch_dims: int, names: Sequence[Any],
            rename_map: dict) -> list:
    """The names ``rename_(*names, **rename_map)`` gives batch dims now named ``current``."""
    if names and rename_map:
        raise ValueError("rename_() takes a name list or a name map (old='new'), not both.")
    if not names and not rename_map:
        raise ValueError("rename_() needs a name list or a name map (old='new').")
    if names:
        return list(names)
    new = list(current) if current is not None else [None] * batch_dims
    for old, name in rename_map.items():
        if old not in new:
            raise ValueError(f"rename_({old}=...): no batch dim is named {old!r} (the names are {new}).")
        new[new.index(old)] = name
    return new


def resized_names(names: Sequence[str | None], dims: int) -> list:
    """``names`` for a batch size of ``dims`` dims: the dims that stay keep their names,
    by position, and new dims are unnamed (the ``batch_size`` setter's rule, as
    tensordict 0.15.3's).

    Example:
        >>> resized_names(["x", "y"], 1), resized_names(["x"], 3)
        (['x'], ['x', None, None])
    """
    return (list(names) + [None] * dims)[:dims]


def carries_names(child: Any) -> bool:
    """Whether ``child`` (a nested entry, unwrapped) names its batch dims after its
    parent's: a TensorDict (NamedBatchDims) or a lazy stack (lazy_names.LazyNames), which
    both take a parent's names through ``_rename_leading`` (the lazy stack is in a module
    above this one: asked by that method, not by class)."""
    return hasattr(type(child), "_rename_leading")


class NamedBatchDims:
    """Mixin of TensorDict (it relies on ``_names``, ``_batch_size`` and ``_tensordict``)."""

    @property
    def names(self) -> list | None:
        """Names of the batch dims (None if unnamed)."""
        return None if self._names is None else list(self._names)

    @names.setter
    def names(self, names: Sequence[str | None] | None) -> None:
        # Checked in full (here and in every nested tensordict) before anything is stored.
        leading = [None] * len(self._batch_size) if names is None else check_names(names, self._batch_size)
        self._rename_leading(leading, check_only=True)
        self._rename_leading(leading, check_only=False)

    def refine_names(self, *names: Any) -> "NamedBatchDims":
        """Name the unnamed batch dims and check the named ones, in place (nested
        tensordicts follow); returns self. As ``torch.Tensor.refine_names`` and tensordict
        0.15.3: each of ``names`` goes with one batch dim; an unnamed dim takes it (or
        stays unnamed for None), a named dim must be given its own name; one ``...``
        stands for the dims it covers and keeps their names. To rename, set ``names``.

        Raises:
            RuntimeError: a named dim given another name or None (nothing is renamed).
            ValueError: not one name per batch dim, more than one ``...``, or a name
                used twice.

        Example:
            >>> td = TensorDict(a={"b": torch.zeros(2, 3)}, batch_size=[2, 3], names=["env", None])
            >>> td.refine_names(..., "time")["a"].names
            ['env', 'time']
        """
        self.names = refined_names(self.names, len(self.batch_size), names)
        return self

    def rename_(self, *names: Any, **rename_map: str | None) -> "NamedBatchDims":
        """Rename the batch dims in place (nested tensordicts follow); returns self.
        ``rename_("a", None, "c")`` gives every dim its name, as ``names = [...]`` does;
        ``rename_(old="new")`` renames the dims named so. As tensordict 0.15.3.

        Raises:
            ValueError: both or neither of a name list and a name map, a name in the map
                that no dim has, or a name then used twice (nothing is renamed).
        """
        self.names = renamed(self.names, len(self.batch_size), names, rename_map)
        return self

    def rename(self, *names: Any, **rename_map: str | None) -> Any:
        """A shallow copy (``clone(recurse=False)``: the same tensors) whose batch dims are
        renamed as ``rename_`` does; this tensordict keeps its names."""
        new_names = renamed(self.names, len(self.batch_size), names, rename_map)
        copy = self.clone(recurse=False)
        copy.names = new_names
        return copy

    def _rename_leading(self, leading: list, *, check_only: bool) -> None:
        """Give the first ``len(leading)`` batch dims these names, here and below."""
        current = self._names or [None] * len(self._batch_size)
        names = list(leading) + current[len(leading):]
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise NameClashError(
                f"Cannot name the batch dims {names}: a name is used twice, names would be "
                f"non-unique (the parent's names are {list(leading)}, this tensordict's "
                f"{self.names}). Rename this tensordict's dims first."
            )
        for child in self._named_children():
            child._rename_leading(names, check_only=check_only)
        if not check_only:
            self._names = None if not named else names

    def _rename_after_resize(self) -> None:
        """After ``batch_size = ...`` changed the number of batch dims (``_names`` still
        the old ones): the dims that stay keep their names and new dims are unnamed, in
        this tensordict and in the leading dims of its nested ones (a nested tensordict
        that named a new dim loses that name), as tensordict 0.15.3 does.

        Example:
            >>> td = TensorDict(a=torch.zeros(3, 4), batch_size=[3, 4], names=["x", "y"])
            >>> td.batch_size = [3]
            >>> td.names
            ['x']
        """
        old = self._names
        self._names = None  # (the setter reads the current names for the dims it is not given)
        self.names = resized_names(old, len(self._batch_size))

    def _named_children(self) -> list:
        """The nested TensorDicts (also inside tensorclasses) that carry our names."""
        children = []
        for value in self._tensordict.values():
            inner = unwrap_tensorclass(value)
            if carries_names(inner):
                children.append(inner)
        return children

    def _adopt_names(self, key: str, child: Any) -> Any:
        """``child`` (about to be stored under ``key``) with its leading dims named like
        ours: itself when they are, else a shallow copy (``clone(recurse=False)``: the
        same tensors) renamed, as tensordict 0.15.3 does, so that the caller's object
        keeps its names. If ours are unnamed, ours (and our other children's) are named
        like the child's, which is returned as it is.

        Raises RuntimeError, with nothing renamed, if the child already has other names
        for those dims (or if its names clash with another child's).

        Example:
            >>> child = TensorDict(a=torch.zeros(3), batch_size=[3])
            >>> parent = TensorDict(c=child, batch_size=[3], names=["time"])
            >>> parent["c"].names, child.names, parent["c"]["a"] is child["a"]
            (['time'], None, True)
        """
        inner = unwrap_tensorclass(child)
        if not carries_names(inner) or not len(self._batch_size):
            return child  # (no batch dim of ours for the child to share)
        names = names_after_set(self._names, len(self._batch_size), key, inner)  # (checks all)
        if self._names is None:
            # an unnamed tensordict takes a named child's names of its dims (and its other
            # children with it), as tensordict 0.15.3 does
            if names is not None:
                self.names = names
            return child
        if _leading_names(inner, len(names)) == names:
            return child
        copy = child.clone(recurse=False)
        unwrap_tensorclass(copy)._rename_leading(self._names, check_only=False)
        return copy


def names_after_set(names: list | None, batch_dims: int, key: str, child: Any) -> list | None:
    """The names of a tensordict's ``batch_dims`` batch dims, now ``names`` (None:
    unnamed), once ``child`` (unwrapped) is set under ``key`` (see
    :meth:`NamedBatchDims._adopt_names`). Only checks: nothing is renamed; ``update``
    plans its writes with it, so that a clash raises before the first write.

    Raises:
        RuntimeError: the child names those dims otherwise (NameClashError: our names
            would be used twice in it).

    Example:
        >>> child = TensorDict(batch_size=[3], names=["env"])
        >>> names_after_set(None, 1, "c", child), names_after_set(["env"], 1, "c", child)
        (['env'], ['env'])
    """
    if not carries_names(child) or not batch_dims:
        return names
    theirs = _leading_names(child, batch_dims)
    if names is None:
        return theirs if any(name is not None for name in theirs) else None
    clash = [(a, b) for a, b in zip(names, theirs) if b is not None and a != b]
    if clash:
        raise RuntimeError(
            f"Cannot set {key!r}: its batch dims are named {child.names}, which do not "
            f"match this tensordict's names {list(names)}. Rename one of them first "
            f"(e.g. value.names = None)."
        )
    if theirs != list(names):
        child._rename_leading(list(names), check_only=True)
    return names


def _leading_names(child: Any, dims: int) -> list:
    """The names of the first ``dims`` batch dims of ``child`` (None for an unnamed one)."""
    return (child.names or [None] * child.batch_dims)[:dims]
