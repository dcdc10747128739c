"""Small tensordict 0.15.3 names that RL code uses every day: ``apply_``, ``dtype``,
``depth``, ``tensor_split`` and ``split_keys`` (the mixin ExtraNameOps of
TensorDictBase, so a TensorDict, a lazy stack and every tensorclass get them; the
work of ``split_keys`` is in extra_split_keys.py), and the classmethods
``stack``, ``cat``, ``maybe_dense_stack``, ``fromkeys``, ``from_list`` and
``from_dataclass`` (see :mod:`shared_td.containers.extra_constructors`, which does
their work: they are thin doors onto ``torch.stack``, ``torch.cat``, ``lazy_stack`` and
``shared_td.from_dataclass``).

Each method takes ``self`` as a tensordict or a tensorclass instance: the tensorclass
gets the methods of TensorDictBase's mixins as they are (tensorclass_members.py).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch

from shared_td.containers import batch as batch_ops
from shared_td.containers import extra_constructors as build
from shared_td.containers import extra_split_keys as split_key_parts
from shared_td.containers.value_kinds import is_lazy_stack, is_leaf_nontensor, is_non_tensor, is_tensor_collection
from shared_td.keys import NestedKey
from shared_td.tensorclass_protocol import unwrap_tensorclass


class ExtraNameOps:
    """Mixin of TensorDictBase (and, through it, of every tensorclass)."""

    # ------------------------------------------------------------ apply_
    def apply_(self, fn: Callable, *others: Any, **kwargs: Any) -> Any:
        """Apply ``fn`` to every tensor leaf and write each result into that leaf, in
        place (as ``set_``: the leaves keep their storage, so a memory-mapped or shared
        tensordict is written through to its file or segment); returns self.

        ``fn(leaf, *other_leaves)`` gets the same key of each of ``others``; a None result
        leaves that leaf as it is; non-tensor entries are left alone. The keywords of
        ``apply`` (``batch_size``, ``names``, ``device``) are accepted; the written
        leaves keep their own batch size, names and device, as in tensordict. A locked
        tensordict may be written (``set_`` may).

        All or nothing: ``fn`` runs on every leaf and every result is checked (shape,
        type) before the first write, so when ``fn`` raises or a result does not fit,
        nothing is written (tensordict 0.15.3 writes the leaves before the failing one).
        The price is that the results are held until they are written, as ``apply``
        holds them in the tensordict it returns.

        Raises:
            TypeError: ``inplace=`` given (apply_ is in place), or a result that is not
                a tensor. BatchSizeMismatchError: (a RuntimeError, as tensordict's) a
                result that does not fit its leaf. KeyError: a key that one of
                ``others`` lacks.

        Example:
            >>> td = TensorDict(a=torch.zeros(3), b={"c": torch.ones(3)}, batch_size=[3])
            >>> a = td["a"]
            >>> td.apply_(lambda x: x + 1) is td, a.tolist(), td["b", "c"].tolist()
            (True, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
        """
        if "inplace" in kwargs:  # (tensordict: apply() got multiple values for 'inplace')
            raise TypeError("apply_() writes in place: it takes no inplace= argument; use "
                            "apply(fn, inplace=...) to choose.")
        # (every result is made and checked before the first is written: see apply)
        unwrap_tensorclass(self).apply(fn, *map(unwrap_tensorclass, others), inplace=True, **kwargs)
        return self

    # ------------------------------------------------------------ dtype, depth
    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of every tensor leaf, or None when they differ or there is none
        (non-tensor entries do not count), as in tensordict 0.15.3. A lazy stack reads
        its members' leaves, never stacked copies of them.

        Example:
            >>> TensorDict(a=torch.zeros(2), b={"c": torch.ones(2)}).dtype
            torch.float32
            >>> print(TensorDict(a=torch.zeros(2), b=torch.ones(2, dtype=torch.int64)).dtype)
            None
        """
        found = None
        for leaf in unwrap_tensorclass(self)._leaf_tensors():
            if found is None:
                found = leaf.dtype
            elif leaf.dtype != found:
                return None
        return found

    @property
    def depth(self) -> int:
        """How many levels of nested tensordicts hold a leaf (tensor or non-tensor): 0
        for a flat tensordict; an empty nested tensordict does not count, as in
        tensordict 0.15.3.

        Example:
            >>> TensorDict(a=0).depth, TensorDict(a={"b": {"c": 0}}).depth, TensorDict(a={}).depth
            (0, 2, 0)
        """
        keys = self.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)
        return max((len(key) - 1 for key in keys if isinstance(key, tuple)), default=0)

    # ------------------------------------------------------------ memory and device
    def data_ptr(self, *, storage: bool = False) -> Any:
        """The data pointer of each tensor leaf (``untyped_storage().data_ptr()`` with
        ``storage=True``, which a view shares with its base), as a TensorDict of 0-d int64
        tensors with this one's keys, an empty batch size and the CPU device, as in
        tensordict 0.15.3: compare two to check that they share memory. A lazy stack
        gives one entry per member (``"0"``, ``"1"``, ...); non-tensor values have none.

        Example:
            >>> td = TensorDict(a=torch.zeros(2), batch_size=[2])
            >>> bool((td[:1].data_ptr() == td.data_ptr()).all()), bool((td[1:].data_ptr() == td.data_ptr()).all())
            (True, False)
        """
        from shared_td.containers.tensordict import TensorDict  # (it imports this module's layer)

        return TensorDict(_pointers(self, storage), device="cpu")

    def is_contiguous(self) -> bool:
        """Whether every tensor leaf is contiguous; a lazy stack (a NonTensorStack too), whose
        leaves are stacked when read, is not, also below the root (as in tensordict 0.15.3)."""
        node = unwrap_tensorclass(self)
        if is_lazy_stack(node) or (is_non_tensor(node) and not node._one_value):
            return False
        return all(value.is_contiguous() for _, value in node._items_str()
                   if isinstance(value, torch.Tensor) or is_tensor_collection(value))

    @property
    def is_cpu(self) -> bool:
        """Whether the tensordict's device is the CPU (False when it has none)."""
        return self.device is not None and self.device.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        """Whether the tensordict's device is a CUDA one (False when it has none)."""
        return self.device is not None and self.device.type == "cuda"

    @property
    def is_meta(self) -> bool:
        """Whether the tensordict's device is the meta device (False when it has none)."""
        return self.device is not None and self.device.type == "meta"

    # ------------------------------------------------------------ tensor_split
    def tensor_split(self, indices_or_sections: int | Sequence[int] | torch.Tensor, dim: int = 0) -> tuple:
        """Split along batch dim ``dim`` as ``torch.tensor_split``: views of the pieces.

        An int ``n`` (or a 0-d long tensor) gives ``n`` pieces, the first
        ``size % n`` one element longer; a list, tuple or 1-d long tensor of indices
        splits before each index (negative ones count from the end, those past the end
        are clamped, and an index smaller than the one before gives an empty piece and
        then one that overlaps, as in torch). Pieces of a locked tensordict are locked
        and keep the dim names, as ``split``'s.

        Raises:
            ValueError: ``indices_or_sections`` of another type, a tensor that is not a
                0-d or 1-d long tensor on the CPU, or fewer than 1 section.
            BatchDimError: (an IndexError, as tensordict's) ``dim`` is not a batch dim.

        Example:
            >>> td = TensorDict(x=torch.arange(5), batch_size=[5])
            >>> [t["x"].tolist() for t in td.tensor_split(2)], [t["x"].tolist() for t in td.tensor_split([1, 3])]
            ([[0, 1, 2], [3, 4]], [[0], [1, 2], [3, 4]])
        """
        spec = _split_spec(indices_or_sections)
        dim = batch_ops.normalize_dim(dim, self.batch_dims)
        size = self.batch_size[dim]
        if isinstance(spec, int):
            short, extra = divmod(size, spec)
            return tuple(self.split([short + (i < extra) for i in range(spec)], dim))
        bounds = [0] + [min(max(i + size if i < 0 else i, 0), size) for i in spec] + [size]
        prefix = (slice(None),) * dim
        # each piece by its own slice: a decreasing index gives an empty piece and an
        # overlapping one, which split (consecutive pieces) cannot express; a tensordict's
        # read with _index as split reads them (see splitting.py: a lazy stack's pieces are
        # tensordicts), a tensorclass's with its own indexing (its pieces are instances)
        rows = self._index if unwrap_tensorclass(self) is self else self.__getitem__
        return tuple(rows(prefix + (slice(start, max(start, stop)),)) for start, stop in zip(bounds, bounds[1:]))

    # ------------------------------------------------------------ split_keys
    def split_keys(self, *key_sets: Any, inplace: bool = False, default: Any = split_key_parts.NO_DEFAULT,
                   strict: bool = True, reproduce_struct: bool = False) -> tuple:
        """One tensordict per set of keys, plus one of the entries no set took (N + 1
        parts for N sets), holding the same tensors (nothing is copied), as in
        tensordict 0.15.3.

        A set is a list of keys, a dict ``{key: new_key}`` (renamed in its part) or a
        callable ``fn(key, value) -> bool`` called on each tensor leaf that no earlier
        set took (``key`` a tuple). ``strict=True``: a missing key raises KeyError;
        ``strict=False``: it is skipped, or given ``default`` (not None) in its part.
        ``inplace=True``: the taken entries are removed from self, the last part (a
        KeyError changes nothing). Empty nested tensordicts are dropped from the last
        part, unless ``reproduce_struct=True``, which gives every part the tree of
        nested tensordicts.

        Example:
            >>> td = TensorDict(a=0, b=0, c={"d": 0})
            >>> [sorted(map(str, p.keys(True, True))) for p in td.split_keys(["a"], [("c", "d")])]
            [['a'], ["('c', 'd')"], ['b']]
        """
        target = unwrap_tensorclass(self)
        parts = split_key_parts.split_keys(target, key_sets, inplace=inplace, default=default, strict=strict,
                                           reproduce_struct=reproduce_struct)
        if target is self:
            return parts
        return tuple(self if part is target else build.wrap_for(type(self), part) for part in parts)

    def separates(self, *keys: NestedKey, default: Any = split_key_parts.NO_DEFAULT, strict: bool = True,
                  filter_empty: bool = True) -> Any:
        """Remove the entries ``keys`` from self, in place, and return them in a new
        tensordict (the same tensors: nothing is copied) that keeps the nested
        tensordicts holding them, with their batch sizes (tensordict 0.15.3's
        ``separates``: ``split_keys(keys, inplace=True)``, the separated part only).
        ``strict=True`` and no ``default``: a missing key is a KeyError and self is left
        whole (tensordict 0.15.3 has removed the keys before it by then); else it is
        given ``default`` (not None) in the result, or skipped. The result holds the
        separated entries only (tensordict 0.15.3 also puts a copy of self's other
        non-tensor entries there). ``filter_empty=True``: the nested tensordicts of self
        that the removal leaves empty are removed too (not those empty before). A locked
        tensordict on a key's path is refused before any key is removed.

        Example:
            >>> td = TensorDict(a=torch.zeros(3), b=torch.zeros(3), n={"c": torch.zeros(3)}, batch_size=[3])
            >>> out = td.separates("a", ("n", "c"))
            >>> sorted(map(str, out.keys(True, True))), list(td.keys())
            (["('n', 'c')", 'a'], ['b'])
        """
        strict = strict and default is split_key_parts.NO_DEFAULT  # (a default given: a missing key takes it)
        separated, rest = self.split_keys(keys, inplace=True, default=default, strict=strict, reproduce_struct=True)
        split_key_parts.drop_empty(unwrap_tensorclass(separated))
        if filter_empty:  # (the nested tensordicts on the removed keys' paths only: those
            for key in keys:  # are unlocked, as each key's was; others are the user's)
                split_key_parts.drop_emptied(rest, key)
        return separated

    # ------------------------------------------------------------ classmethods
    @classmethod
    def stack(cls, input: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
        """``torch.stack(input, dim, out=out)``, as a classmethod (tensordict 0.15.3):
        a dense TensorDict, or a RuntimeError naming the key when keys or shapes
        differ (use ``maybe_dense_stack`` or ``lazy_stack`` for those).

        Example:
            >>> a = TensorDict(x=torch.zeros(3), batch_size=[3])
            >>> TensorDict.stack([a, a.clone()]).batch_size
            torch.Size([2, 3])
        """
        return build.wrap_for(cls, build.stack(input, dim, out=out))

    @classmethod
    def cat(cls, input: Sequence[Any], dim: int = 0, *, out: Any = None) -> Any:
        """``torch.cat(input, dim, out=out)``, as a classmethod (tensordict 0.15.3).

        Example:
            >>> a = TensorDict(x=torch.zeros(3), batch_size=[3])
            >>> TensorDict.cat([a, a]).batch_size
            torch.Size([6])
        """
        return build.wrap_for(cls, build.cat(input, dim, out=out))

    @classmethod
    def maybe_dense_stack(cls, input: Sequence[Any], dim: int = 0, *, out: Any = None, strict: bool = False) -> Any:
        """A dense stack when the items have the same keys and shapes, else a lazy
        stack (see :func:`shared_td.maybe_dense_stack`).

        Example:
            >>> a, b = TensorDict(x=torch.zeros(3)), TensorDict(y=torch.zeros(3))
            >>> type(TensorDict.maybe_dense_stack([a, a])).__name__, type(TensorDict.maybe_dense_stack([a, b])).__name__
            ('TensorDict', 'LazyStackedTensorDict')
        """
        return build.wrap_for(cls, build.maybe_dense_stack(input, dim, out=out, strict=strict))

    @classmethod
    def fromkeys(cls, keys: Sequence[Any], value: Any = 0) -> Any:
        """A TensorDict of batch size ``[]`` with ``value`` under every key (a nested key
        makes nested tensordicts), as ``dict.fromkeys`` (tensordict 0.15.3): a number
        becomes a tensor per key, a tensor is the same object under every key.

        Example:
            >>> td = TensorDict.fromkeys(["a", ("b", "c")], 1)
            >>> td["b", "c"]
            tensor(1)
        """
        return build.wrap_for(cls, build.fromkeys(keys, value))

    @classmethod
    def from_list(cls, input: Sequence[Any], *, auto_batch_size: bool | None = None, batch_size: Any = None,
                  device: Any = None, batch_dims: int | None = None, names: Any = None,
                  lazy: bool | None = None) -> Any:
        """Stack a list of dicts (each built by ``from_dict``) or tensordicts along a new
        first dim (see :func:`shared_td.containers.extra_constructors.from_list`; on
        ``LazyStackedTensorDict`` the result is always a lazy stack, and ``batch_size``
        is each member's).

        Example:
            >>> td = TensorDict.from_list([{"a": torch.zeros(3)}, {"a": torch.ones(3)}], batch_size=[2, 3])
            >>> type(td).__name__, td.batch_size
            ('TensorDict', torch.Size([2, 3]))
        """
        options = dict(auto_batch_size=auto_batch_size, batch_size=batch_size, device=device,
                       batch_dims=batch_dims, names=names)
        if build.is_lazy_class(cls):
            return build.lazy_from_list(input, **options)
        return build.wrap_for(cls, build.from_list(input, lazy=lazy, **options))

    @classmethod
    def from_dataclass(cls, dataclass: Any, *, dest_cls: type | None = None, auto_batch_size: bool = False,
                       batch_dims: int | None = None, as_tensorclass: bool = False, device: Any = None,
                       batch_size: Any = None) -> Any:
        """A TensorDict of the fields of a dataclass instance (nested dataclasses and
        dicts become nested TensorDicts), or with ``as_tensorclass=True`` what
        :func:`shared_td.from_dataclass` makes (a tensorclass instance or type).

        Example:
            >>> import dataclasses
            >>> @dataclasses.dataclass
            ... class Step:
            ...     obs: torch.Tensor
            >>> TensorDict.from_dataclass(Step(torch.zeros(3, 4)), auto_batch_size=True).batch_size
            torch.Size([3, 4])
        """
        if as_tensorclass:
            from shared_td.containers.tensorclass import from_dataclass

            return from_dataclass(dataclass, dest_cls=dest_cls, auto_batch_size=auto_batch_size,
                                  batch_dims=batch_dims, device=device, batch_size=batch_size)
        return build.wrap_for(cls, build.tensordict_from_dataclass(
            dataclass, auto_batch_size=auto_batch_size, batch_dims=batch_dims, device=device,
            batch_size=batch_size))


def _split_spec(indices_or_sections: Any) -> int | list[int]:
    """``tensor_split``'s first argument as a number of sections or a list of indices,
    checked as tensordict 0.15.3 checks it (ValueError)."""
    spec = indices_or_sections
    if isinstance(spec, torch.Tensor):
        if spec.dtype != torch.long or spec.device.type != "cpu" or spec.ndim > 1:
            raise ValueError(
                "tensor_split: a tensor indices_or_sections must be a 0-d or 1-d long tensor on "
                f"the CPU, got a {spec.ndim}-d {spec.dtype} tensor on {spec.device}."
            )
        spec = spec.tolist()  # a 0-d tensor gives a number of sections, a 1-d one indices
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"tensor_split: the number of sections must be at least 1, got {spec}.")
        return spec
    if not isinstance(spec, (list, tuple)):
        raise ValueError(
            "tensor_split: indices_or_sections must be an int, a list or tuple of ints, or a "
            f"0-d or 1-d long tensor, got a {type(indices_or_sections).__name__}."
        )
    return [operator.index(i) for i in spec]


def _pointers(obj: Any, storage: bool) -> dict:
    node = unwrap_tensorclass(obj)
    if is_lazy_stack(node):
        return {str(i): _pointers(member, storage) for i, member in enumerate(node.tensordicts)}
    pointers = {}
    for key in node.keys():
        value = node.get(key)
        if isinstance(value, torch.Tensor):
            pointers[key] = value.untyped_storage().data_ptr() if storage else value.data_ptr()
        elif is_tensor_collection(value) and not is_non_tensor(value):
            pointers[key] = _pointers(value, storage)
    return pointers
