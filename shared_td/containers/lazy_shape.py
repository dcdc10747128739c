"""New lazy stacks built member by member, as a mixin of LazyStackedTensorDict
(LazyShapeOps): indexing, shape ops, torch.cat and the member-wise maps (clone, to,
select, ...; apply is in lazy_apply.py).

Indexing and shape ops answer one question: which members (and which elements inside
them) a batch position maps to. ``_locate`` sends an index that stays inside single
members to them (so ``lazy[i]`` is the member itself and slices along ``stack_dim`` keep
the members); any other index falls back to flat positions, giving nested lazy stacks
of the selected elements. Shape ops are applied to each member and move ``stack_dim``.
Neither copies a tensor.

This module does not import lazy.py (lazy.py imports it): new stacks are built with
``self._restack`` or ``cls``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers.base import NO_DEFAULT
from shared_td.containers.keysview import peek_path
from shared_td.containers.lazy_names import indexed_names
from shared_td.containers.reshaping import permute_order, view_dtype
from shared_td.containers.shape_write_back import back_to_types_of, inverse_order, unsqueezed, with_write_back
from shared_td.containers.value_kinds import is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.keys import NestedKey, is_nested_key, key_repr, unravel_key
from shared_td.tensorclass_protocol import unwrap_tensorclass

if TYPE_CHECKING:  # for the annotations only: lazy.py imports this module
    from shared_td.containers.lazy import LazyStackedTensorDict


class LazyShapeOps:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_stack_dim``,
    ``batch_size``, ``_restack`` and LazyWriteOps's ``_unbind_like``)."""

    # ---------------------------------------------------------------- indexing
    def _locate(self, index: Any) -> tuple:
        """Where ``index`` goes: ``("one", i, rest)`` for one member, ``("many", members,
        rest, stack_dim, batch_size)`` for several, or ``("positions", positions)``."""
        size, sd = self.batch_size, self._stack_dim
        parts = _reversed_members(batch_ops.normalize_index(index, size), sd, len(self.tensordicts))
        out_batch = batch_ops.indexed_batch_size(size, parts)
        parts = tuple(_scalar_to_python(p) for p in parts)
        widths = [_dims(p)[0] for p in parts]
        parts += (slice(None),) * (len(size) - sum(widths))
        widths += [1] * (len(parts) - len(widths))
        tensors = sum(isinstance(p, torch.Tensor) for p in parts)
        bools = sum(isinstance(p, bool) for p in parts)
        general = ("positions", parts)
        if tensors > 1 or (bools and (tensors or bools > 1)):
            # (a bool is an index tensor to torch: beside another one, or another bool,
            # it is broadcast with it; alone it adds one dim, of size 1 or 0, as None
            # does, so the members are indexed with it, as tensordict 0.15.3 does)
            return general
        dim = out = 0
        for i, (part, width) in enumerate(zip(parts, widths)):
            if width and dim <= sd < dim + width:
                break
            dim += width
            out += _dims(part)[1]
        rest = parts[:i] + parts[i + 1 :]
        count = len(self.tensordicts)
        if isinstance(part, int):
            # torch selects with ints before it places the block of index tensors, so
            # an int at the stack dim is one member indexed with the rest, as tensordict
            # gives it (a copy for an index tensor, named as the member names it)
            return ("one", part % count, rest)
        if width != 1 or (tensors and not isinstance(part, (slice, torch.Tensor))):
            return general
        if isinstance(part, slice):
            chosen = list(range(count))[part]
        elif part.dtype == torch.bool:
            chosen = part.nonzero().flatten().tolist()
        elif part.ndim == 1:
            chosen = [j % count for j in part.tolist()]
        else:
            return general
        return ("many", chosen, rest, out, out_batch)

    def __getitem__(self, index: Any) -> Any:
        """``lazy[key]``: the entry (see ``get``); ``lazy[index]``: the rows, with the
        members given as tensorclasses given back so, as tensordict 0.15.3 gives them
        (``_index(index, as_given=True)``)."""
        if isinstance(index, str) or (isinstance(index, tuple) and is_nested_key(index)):
            return super().__getitem__(index)
        return self._index(index, as_given=True)

    def _index(self, index: Any, as_given: bool = False) -> Any:
        """The rows at ``index``: members, and new stacks of (indexed) members, as
        tensordicts. ``as_given`` (``lazy[index]``): a member given as a tensorclass is
        that tensorclass (``lazy[0]``, ``lazy[0, 1:]``), and a new stack whose members
        were all given as one tensorclass is that class over the stack of their
        tensordicts (``lazy[::2]``), as in tensordict 0.15.3 (as ``lazy_stack`` gives)."""
        staged = self._reversal(index, with_tensors_only=True)
        if staged is not None:  # (lazy[::-1, [1, 0]]: the members reversed, then the rest)
            return self._index(staged[0])._index(staged[1], as_given)
        where = self._locate(index)
        if self.tensordicts and -1 not in self.batch_size and _selects_no_member(where, self):
            empty = self._empty_selection(index, where)
            cls = self._one_tensorclass() if as_given else None
            # (members all given as one tensorclass: that class around it, as tensordict 0.15.3 gives)
            return cls._from_tensordict(empty, _lock=False) if cls is not None else empty
        if where[0] == "one":
            member = self.tensordicts[where[1]]
            out = member if _trivial(where[2]) else member._index(where[2])
            return self._member_as_given(member, out) if as_given else out
        if where[0] == "many":
            _, chosen, rest, out, out_batch = where
            sources = [self.tensordicts[i] for i in chosen]
            members = sources if _trivial(rest) else [m._index(rest) for m in sources]
            stacked = self._restack(members, out, out_batch, sources=sources)
        else:
            positions = self._positions(where[1])
            # an index tensor or mask across the stack dim copies, as torch's advanced
            # indexing (and tensordict 0.15.3) does: no view of the members' memory
            advanced = any(isinstance(p, (torch.Tensor, bool)) for p in where[1])  # (a bool too, for torch)
            stacked = self._from_positions(positions, copies=advanced)
            if positions.ndim:  # a new stack of views (never a member itself): name it
                indexed_names(self, stacked, where[1])
        return self._one_class_view(stacked) if as_given else stacked

    def _reversal(self, index: Any, with_tensors_only: bool = False) -> tuple | None:
        """``(members, rest)`` for an index with a slice of negative step at the stack dim
        (None for any other): ``lazy[index]`` is ``lazy[members][rest]``, the members
        reversed (as tensordict 0.15.3 slices its list of members) and then the rest of
        the index with ``:`` there, which torch takes (it refuses a negative step).
        ``with_tensors_only``: only beside an index tensor, which ``_locate`` leaves to
        refuse (it would be broadcast with the members' one).

        Example:
            >>> lazy = LazyStackedTensorDict(*[TensorDict(a=torch.full((2,), float(i)), batch_size=[2])
            ...                                for i in range(3)])
            >>> lazy[::-1, [1, 0]]["a"].tolist(), lazy._reversal((slice(None, None, -1), 0))[1]
            ([[2.0, 2.0], [1.0, 1.0], [0.0, 0.0]], (slice(None, None, None), 0))
        """
        if isinstance(index, str) or (isinstance(index, tuple) and is_nested_key(index)):
            return None
        try:
            parts = batch_ops.normalize_index(index, self.batch_size)
        except (IndexError, TypeError):
            return None  # (left to the index itself to refuse, with its own error)
        if with_tensors_only and not any(isinstance(p, (torch.Tensor, bool)) for p in parts):
            return None
        dim = 0
        for i, part in enumerate(parts):
            width = _dims(part)[0]
            if width and dim <= self._stack_dim < dim + width:
                if not (isinstance(part, slice) and isinstance(part.step, int) and part.step < 0):
                    return None
                chosen = torch.tensor(list(range(len(self.tensordicts)))[part], dtype=torch.long)
                return (slice(None),) * dim + (chosen,), parts[:i] + (slice(None),) + parts[i + 1:]
            dim += width
        return None

    def _set_rows(self, index: Any, value: Any) -> None:
        """``lazy[index] = value``; at a slice of negative step at the stack dim
        (``lazy[::-1] = value``), written into the stack of the reversed members (the
        members themselves, so that the writes reach them) at the rest of the index:
        torch refused the slice (tensordict 0.15.3 writes it)."""
        staged = self._reversal(index)
        if staged is None:
            return super()._set_rows(index, value)
        self._index(staged[0])._set_rows(staged[1], value)

    def _empty_selection(self, index: Any, where: tuple) -> Any:
        """``lazy[index]`` for an index that keeps no member: an empty TensorDict with the
        keys that every member has, their shapes those of the first member, as the dense
        copy would give (tensordict 0.15.3 does the same); non-tensor entries become
        empty stacks. A first member that is a lazy stack whose entries differ in shape
        gives instead its own selection by the rest of the index, with an empty dim
        where the stack dim goes (or, for an index tensor or mask across the stack dim,
        the selection of it standing for every member): a lazy stack, as tensordict's (a
        dense copy of it raised "Failed to stack tensors").

        Example:
            >>> inner = shared_td.lazy_stack([TensorDict(h=torch.zeros(1)), TensorDict(h=torch.zeros(2))])
            >>> shared_td.lazy_stack([inner, inner.clone()])[2:].batch_size
            torch.Size([0, 2])
        """
        from shared_td.containers.lazy_writes import _is_lazy
        from shared_td.containers.tensordict import TensorDict

        out_batch = torch.zeros(self.batch_size)[index].shape
        names = TensorDict({}, batch_size=self.batch_size, names=self.names)[index].names
        first = self.tensordicts[0]
        if _is_lazy(first) and first._has_ragged_leaf():
            if where[0] == "many":
                _, _, rest, out, _ = where
                part = first if _trivial(rest) else first._index(rest)
                empty = part.unsqueeze(out).expand(out_batch)  # (new members: naming them names no member)
            else:  # (an index tensor or mask across the stack dim: first stands for every member)
                empty = first.unsqueeze(self._stack_dim).expand(self.batch_size)[index]
            if names is not None and any(name is not None for name in names):
                empty.names = names
            return empty
        entries = _empty_entries(self, first, index, out_batch, first.batch_dims)
        return TensorDict(entries, batch_size=out_batch, device=self.device, names=names)

    def _positions(self, parts: tuple) -> torch.Tensor:
        """The flat positions of the elements that ``parts`` selects (torch's rules)."""
        return torch.arange(self.numel()).reshape(self.batch_size)[parts]

    def _element(self, flat: int) -> tuple:
        """(member, index in the member) of the element at flat position ``flat``."""
        coords = []
        for n in reversed(self.batch_size):
            coords.append(flat % n)
            flat //= n
        coords.reverse()
        sd = self._stack_dim
        return self.tensordicts[coords[sd]], tuple(coords[:sd] + coords[sd + 1 :])

    def _from_positions(self, positions: torch.Tensor, copies: bool = False) -> Any:
        """Nested lazy stacks (along dim 0) of the elements at ``positions`` (views, or
        copies with ``copies``); the dims are new ones, unnamed here (``_index`` names
        them after its index; a reshape's stay unnamed, as in tensordict)."""
        if positions.ndim == 0:
            member, sub = self._element(int(positions))
            element = member._index(sub) if sub else member
            return element.clone() if copies else element
        # (the elements of a member keep its tensorclass, as tensordict's do)
        sources = [self._element(int(p))[0] for p in positions] if positions.ndim == 1 else None
        return self._restack([self._from_positions(p, copies) for p in positions.unbind(0)], 0, positions.shape,
                             same_stack_dim=False, sources=sources)

    # ---------------------------------------------------------------- member-wise maps
    def clone(self, recurse: bool = True) -> "LazyStackedTensorDict":
        """A lazy stack of clones of the members (``recurse=False`` shares the tensors)."""
        return self._restack([m.clone(recurse) for m in self.tensordicts], member_wise=True)

    def to(self, *args: Any, **kwargs: Any) -> "LazyStackedTensorDict":
        """Every member moved or cast (self when nothing changes)."""
        from shared_td.containers.to_args import copied_as_root, parse_to

        _device, dtype, _asked = parse_to(args, kwargs, self.batch_size)  # (batch_size= checked here, once)
        kwargs.pop("batch_size", None)
        with copied_as_root(self, []) as result:  # (locked as the stack: see copied_as_root)
            moved = [m.to(*args, **kwargs) for m in self.tensordicts]
            result.append(self if all(a is b for a, b in zip(moved, self.tensordicts))
                          else self._restack(moved, member_wise=True))
        # leaving `with lazy.to(...) as t:` writes t back, on the stack's devices and dtypes
        return with_write_back(self, result[0], back_to_types_of(self, dtype is not None))

    def flatten_keys(self, separator: str = ".", inplace: bool = False,
                     is_leaf: Any = None) -> "LazyStackedTensorDict":
        """Every member's ``flatten_keys``: nested entries as keys joined by ``separator``
        (the keys in the first member's order, as ``keys()``); ``is_leaf`` as
        TensorDict.flatten_keys's."""
        return self._keys_renamed("flatten_keys", separator, inplace,
                                  {} if is_leaf is None else {"is_leaf": is_leaf})

    def unflatten_keys(self, separator: str = ".", inplace: bool = False) -> "LazyStackedTensorDict":
        """The inverse of ``flatten_keys``, member by member."""
        return self._keys_renamed("unflatten_keys", separator, inplace)

    def _keys_renamed(self, method: str, separator: str, inplace: bool,
                      options: dict | None = None) -> "LazyStackedTensorDict":
        options = options or {}
        if not inplace:
            out = self._restack([getattr(m, method)(separator, **options) for m in self.tensordicts])
            inverse = "unflatten_keys" if method == "flatten_keys" else "flatten_keys"
            return with_write_back(self, out, lambda result: getattr(result, inverse)(separator))
        for member in self.tensordicts:  # a locked member raises before any is changed
            member._check_unlocked((), f"{method.replace('_', ' ')} in place")
        for member in self.tensordicts:
            getattr(member, method)(separator, inplace=True, **options)
        return self

    def to_lazystack(self, dim: int = 0) -> "LazyStackedTensorDict":
        """The same data stacked lazily along ``dim`` instead (self when it already is);
        the members are then lazy stacks along the old stack dim."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        if dim == self._stack_dim:
            return self
        name = None if self.names is None else self.names[dim]
        return type(self).lazy_stack(list(self.unbind(dim)), dim, stack_dim_name=name)

    def empty(self, recurse: bool = False, *, batch_size: Any = None, device: Any = NO_DEFAULT) -> Any:
        """A lazy stack of the members' ``empty(recurse)`` (on ``device`` if given). A
        ``batch_size`` that keeps this stack's dims up to its stack dim goes to the
        members without the stack dim; any other gives a TensorDict of that batch size,
        as in tensordict 0.15.3 (the members cannot give those dims), which with
        ``recurse=True`` holds the nested collections emptied (a RuntimeError names one
        that does not fit it, as TensorDict.empty's).

        Example:
            >>> lazy = shared_td.lazy_stack([TensorDict(a=torch.zeros(4), batch_size=[4])] * 3)
            >>> type(lazy.empty()).__name__, lazy.empty(batch_size=[3, 2]).batch_size
            ('LazyStackedTensorDict', torch.Size([3, 2]))
            >>> type(lazy.empty(batch_size=[5, 3, 4])).__name__
            'TensorDict'
        """
        options = {} if device is NO_DEFAULT else {"device": device}
        if batch_size is None:
            return self._restack([m.empty(recurse, **options) for m in self.tensordicts], member_wise=True)
        size, dim = batch_ops.as_batch_size(batch_size), self._stack_dim
        if size[:dim + 1] == self.batch_size[:dim + 1]:
            inner = size[:dim] + size[dim + 1:]
            return self._restack([m.empty(recurse, batch_size=inner, **options) for m in self.tensordicts],
                                 member_wise=True)
        from shared_td.containers.tensordict import TensorDict

        # (no tensor leaf left to copy: the emptied stack's nested collections, made dense)
        plain = self.empty(True).to_tensordict() if recurse else TensorDict(batch_size=self.batch_size,
                                                                             device=self.device,
                                                                             names=self.names)
        return plain.empty(recurse, batch_size=size, **options)

    def select(self, *keys: NestedKey, inplace: bool = False, strict: bool = True,
               as_tensordict: bool = False) -> "LazyStackedTensorDict":
        """A lazy stack of the members' ``select(*keys)`` (``as_tensordict`` is ignored, as in tensordict)."""
        out = [m.select(*keys, inplace=inplace, strict=strict) for m in self.tensordicts]
        return self if inplace else self._restack(out)

    def exclude(self, *keys: NestedKey, inplace: bool = False) -> "LazyStackedTensorDict":
        """A lazy stack of the members' ``exclude(*keys)``."""
        out = [m.exclude(*keys, inplace=inplace) for m in self.tensordicts]
        return self if inplace else self._restack(out)

    def zero_(self) -> "LazyStackedTensorDict":
        """Fill every tensor of every member with zeros; returns self (a read-only leaf
        anywhere is refused before the first is written, as TensorDict.zero_)."""
        from shared_td.memmap_tensor import refuse_read_only

        leaves = list(self._leaf_tensors())
        refuse_read_only(leaves, "zero_")
        for leaf in leaves:
            leaf.zero_()
        return self

    def fill_(self, key: NestedKey, value: Any) -> "LazyStackedTensorDict":
        """Fill the entry ``key`` of every member with ``value``, in place; returns self
        (as TensorDict.fill_: a missing key is a KeyError, a read-only tensor refused first)."""
        from shared_td.containers.tensor_methods import fill_entry

        return fill_entry(self, key, value)

    # ---------------------------------------------------------------- shape ops
    def _member_dim(self, dim: int) -> int:
        return dim if dim < self._stack_dim else dim - 1

    # Overrides BatchSplitOps.unbind (split and chunk stay generic: they index, and
    # ``_index`` keeps the members of a slice along ``stack_dim``).
    def unbind(self, dim: int = 0) -> tuple:
        """The members themselves along ``stack_dim`` (one given as a tensorclass as that
        tensorclass, as tensordict 0.15.3 gives it); lazy stacks of views otherwise."""
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        if dim == self._stack_dim:
            return tuple(self._member_as_given(member) for member in self.tensordicts)
        prefix = (slice(None),) * dim
        return tuple(self._index(prefix + (i,)) for i in range(self.batch_size[dim]))

    def unsqueeze(self, dim: int) -> "LazyStackedTensorDict":
        """Insert a batch dim of size 1 in every member; ``stack_dim`` shifts if needed."""
        dim = batch_ops.insertion_dim(dim, self.batch_dims)
        if dim <= self._stack_dim:
            out = self._restack([m.unsqueeze(dim) for m in self.tensordicts], self._stack_dim + 1, member_wise=True)
        else:
            out = self._restack([m.unsqueeze(dim - 1) for m in self.tensordicts], member_wise=True)
        return with_write_back(self, out, lambda result: result.squeeze(dim))

    def squeeze(self, dim: int | None = None) -> Any:
        """Remove batch dims of size 1; squeezing ``stack_dim`` gives the single member."""
        if dim is None:
            dims = [d for d in range(self.batch_dims) if self.batch_size[d] == 1]
            out: Any = self
            for d in reversed(dims):
                out = out.squeeze(d)
        else:
            dim = batch_ops.normalize_dim(dim, self.batch_dims)
            if self.batch_size[dim] != 1:
                return self
            if dim == self._stack_dim:
                return self.tensordicts[0]  # (the member itself: the block writes into it)
            dims = [dim]
            sd = self._stack_dim - (dim < self._stack_dim)
            out = self._restack([m.squeeze(self._member_dim(dim)) for m in self.tensordicts], sd, member_wise=True)
        if any(out is member for member in self.tensordicts):
            return out
        return with_write_back(self, out, lambda result: unsqueezed(result, dims))

    def permute(self, *dims_list: Any, dims: Any = None) -> "LazyStackedTensorDict":
        """Reorder the batch dims (or only the leading ones, as tensordict: see
        ``reshaping.permute_order``): each member is permuted and ``stack_dim`` moves."""
        order = permute_order(dims_list, self.batch_dims, dims)
        sd = self._stack_dim
        member_order = [self._member_dim(d) for d in order if d != sd]
        # (dims=: members without batch dims take [], where permute(*[]) gives no dims at all)
        out = self._restack([m.permute(dims=member_order) for m in self.tensordicts], order.index(sd),
                            member_wise=True)
        return with_write_back(self, out, lambda result: result.permute(inverse_order(order)))

    def expand(self, *shape: Any) -> "LazyStackedTensorDict":
        """Expand the batch dims (each member is expanded: views, no copy)."""
        probe = torch.zeros((), dtype=torch.uint8).expand(self.batch_size)
        size = probe.expand(batch_ops.shape_args(shape)).shape
        sd = self._stack_dim + len(size) - self.batch_dims
        members = self.tensordicts
        if size[sd] != len(members):  # only possible from a single member
            members = members * size[sd]
        member_size = torch.Size(size[:sd] + size[sd + 1 :])
        return self._restack([m.expand(member_size) for m in members], sd, member_wise=True)

    def reshape(self, *shape: Any, size: Any = None) -> Any:
        """Reshape the batch dims: nested lazy stacks of the members' elements (views)."""
        positions = torch.arange(self.numel()).reshape(self.batch_size)
        positions = positions.reshape(batch_ops.shape_args(shape, size))
        if positions.shape == self.batch_size:
            return self
        if positions.numel() == 0 and self.tensordicts:
            # no element: as an index that keeps no member, the entries every member has,
            # empty (nested stacks of no element held no key: tensordict keeps them)
            from shared_td.containers.lazy_writes import _is_lazy

            empty = self[(slice(None),) * self.stack_dim + (slice(0, 0),)]
            if not _is_lazy(empty):
                return empty.reshape(positions.shape)
        return self._from_positions(positions)

    def view(self, *shape: Any, size: Any = None, batch_size: Any = None) -> Any:
        """:meth:`reshape` (views of the members); leaving ``with stack.view(...) as v:``
        writes ``v`` back into the stack (see shape_write_back), as for a TensorDict.
        ``view(dtype)``: each tensor leaf viewed as ``dtype`` (see TensorDict.view)."""
        if len(shape) == 1 and isinstance(shape[0], torch.dtype):
            return view_dtype(self, shape[0], batch_size)
        before = self.batch_size
        return with_write_back(self, self.reshape(*shape, size=size), lambda result: result.reshape(before))

    # ---------------------------------------------------------------- torch.cat
    @classmethod
    def _cat(cls, items: Sequence[Any], dim: int, out: Any = None) -> "LazyStackedTensorDict":
        """``torch.cat`` with lazy stacks: along ``stack_dim`` the members are joined, along
        another dim the i-th members are concatenated. The stack dim keeps the name it
        has in the first lazy stack (tensordict 0.15.3 loses every name)."""
        first = next(item for item in items if isinstance(item, cls))
        sd, name = first._stack_dim, first._stack_dim_name

        def parts(item: Any) -> list:
            if isinstance(item, cls) and item._stack_dim == sd:
                return list(item.tensordicts)
            return list(item.unbind(sd))

        if dim == sd:
            members = [m for item in items for m in parts(item)]
            # (batch_size counts only without members; device would move them)
            result = cls(*members, stack_dim=sd, stack_dim_name=name, batch_size=first._member_batch,
                         device=None if members else first.device)
            result._keep_classes_joined([item for item in items if isinstance(item, cls) and item._stack_dim == sd])
        else:
            member_dim = dim if dim < sd else dim - 1
            groups = zip(*[parts(item) for item in items])
            result = cls(*[torch.cat(list(group), member_dim) for group in groups], stack_dim=sd,
                         stack_dim_name=name)
            result._keep_classes_of(items, sd)
        return _into(out, result)


def set_batch_size(lazy: Any, value: Any) -> None:
    """``lazy.batch_size = value``: its own batch size changes nothing; another is refused,
    as in tensordict 0.15.3 (a stack's batch size is its members' and their count).

    Raises:
        BatchSizeMismatchError: ``value`` is another batch size (a RuntimeError, as
            tensordict raises).

    Example:
        >>> from shared_td import TensorDict, lazy_stack
        >>> lazy = lazy_stack([TensorDict(a=torch.zeros(3), batch_size=[3])] * 2)
        >>> lazy.batch_size = [2, 3]
        >>> lazy.batch_size = [6]
        Traceback (most recent call last):
        ...
        shared_td.errors.BatchSizeMismatchError: Received a new batch size [6] ...
    """
    from shared_td.errors import BatchSizeMismatchError

    if torch.Size(value) != lazy.batch_size:
        raise BatchSizeMismatchError(
            f"Received a new batch size {list(value)} with an existing batch_size {lazy.batch_size!r} in a lazy "
            "TD. Modifying the batch size of a lazy representation of a tensordict is not permitted. Consider "
            "instantiating the tensordict first by calling `td = td.to_tensordict()` before resetting the "
            "batch size.")


def _into(out: Any, result: Any) -> Any:
    """``result``, or ``out`` updated in place with it (the ``out=`` of torch functions)."""
    return result if out is None else out.update_(result)


def stacked_into(out: Any, result: Any) -> Any:
    """``result``, or ``out`` written with it (the ``out=`` of torch.stack and lazy_stack):
    its tensors in place (``out`` keeps its storage), its non-tensor entries replaced by
    the result's, as in tensordict 0.15.3 (a NonTensorStack of the stacked values cannot
    be written in place into ``out``'s NonTensorData); a locked ``out`` (or nested
    node) holding some refuses before anything is written (tensordict writes the
    tensors first). (torch.cat's ``out=`` writes them in
    place, as tensordict's does: see _into.)"""
    if out is None:
        return result
    # (keys, then values of out's non-tensor entries only: reading every leaf of the
    # result would stack a ragged nested lazy stack's tensors, which update_ writes member by member)
    keys = list(result.keys(True, True, is_leaf_nontensor))
    missing = next((key for key in keys if key not in out), None)
    if missing is not None:  # (tensordict 0.15.3 leaves it out in silence)
        raise KeyError(f"stack(..., out=out): out has no entry {key_repr(unravel_key(missing))}, which the stacked "
                       "tensordicts hold; nothing was written. Add it to out, or stack without out=.")
    leaves = {key: result.get(key) for key in keys if is_non_tensor(peek_path(out, unravel_key(key)))}
    replaced = [key for key, value in leaves.items() if is_non_tensor(value)]
    if not replaced:
        return out.update_(result)
    for key in replaced:  # every node whose entry is replaced, before any write
        path = key if isinstance(key, tuple) else (key,)
        parent = out.get(path[:-1]) if len(path) > 1 else out
        if parent.is_locked:
            parent.set(path[-1], leaves[key])  # (raises the locked error, naming the key)
    # (keys_to_update, not exclude: exclude keeps the fields of a nested tensorclass)
    out.update_(result, keys_to_update=[key for key in keys if key not in replaced])
    for key in replaced:
        out.set(key, leaves[key])
    return out


def _empty_entries(stacked: Any, first: Any, index: Any, out_batch: torch.Size, member_dims: int) -> dict:
    """The entries of ``stacked[index]`` for an index that keeps no member (see
    ``_empty_selection``), node by node: ``first`` is the first member's node at the
    same place, ``member_dims`` that member's batch dims. Nested tensordicts stay even
    when they hold no leaf, and tensorclasses keep their class, as in tensordict 0.15.3
    (a walk over the leaves alone lost both)."""
    from shared_td.containers.tensordict import TensorDict

    entries = {}
    for key in stacked._keys_str():  # (the keys that every member has)
        value = first._get_str(key, None)
        if is_non_tensor(value):
            entries[key] = stacked._get_str(key, None)[index]
        elif is_tensor_collection(value):
            node = unwrap_tensorclass(value)
            inner = _empty_entries(unwrap_tensorclass(stacked._get_str(key, None)), node, index, out_batch, member_dims)
            empty = TensorDict(inner, batch_size=(*out_batch, *node.batch_size[member_dims:]))
            entries[key] = empty if node is value else type(value)._from_tensordict(empty)
        else:
            entries[key] = value.new_empty((*out_batch, *value.shape[member_dims:]))
    return entries


def _dims(part: Any) -> tuple[int, int]:
    """How many batch dims an index part consumes and how many it produces (when it is
    the only tensor of the index)."""
    if part is None or isinstance(part, bool):
        return 0, 1
    if isinstance(part, torch.Tensor):
        return (max(part.ndim, 1), 1) if part.dtype == torch.bool else (1, part.ndim)
    return 1, 0 if isinstance(part, int) else 1



def _reversed_members(parts: tuple, stack_dim: int, count: int) -> tuple:
    """``parts`` with a slice of negative step at the stack dim (``lazy[::-1]``) as the
    index tensor of the members it selects, as tensordict 0.15.3 takes it (it slices
    its list of members); torch refuses such a slice, so at any other dim, or beside
    another index tensor (which it would be broadcast with), it is left to refuse."""
    if any(isinstance(p, (torch.Tensor, bool)) for p in parts):
        return parts
    dim = 0
    for i, part in enumerate(parts):
        width = _dims(part)[0]
        if width and dim <= stack_dim < dim + width:
            if isinstance(part, slice) and isinstance(part.step, int) and part.step < 0:
                chosen = torch.tensor(list(range(count))[part], dtype=torch.long)
                return parts[:i] + (chosen,) + parts[i + 1 :]
            return parts
        dim += width
    return parts


def _scalar_to_python(part: Any) -> Any:
    """A 0-d index tensor as the Python int or bool it stands for (a 0-d bool tensor
    adds a dim as ``True``/``False`` does, and is read the same way)."""
    if isinstance(part, torch.Tensor) and part.ndim == 0:
        return bool(part) if part.dtype == torch.bool else int(part)
    return part


def _selects_no_member(where: tuple, lazy: Any) -> bool:
    """True when the located index keeps no element at all."""
    if where[0] == "many":
        return not where[1]
    if where[0] == "positions":
        return lazy._positions(where[1]).numel() == 0
    return False


def _trivial(index: tuple) -> bool:
    return all(isinstance(p, slice) and p == slice(None) for p in index)
