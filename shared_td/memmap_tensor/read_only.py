"""ReadOnlyMemoryMappedTensor: the leaves of a save this process may not write."""

from __future__ import annotations

import numpy as np
import torch

from shared_td.errors import ReadOnlyError
from shared_td.memmap_tensor import tensor as _tensor
from shared_td.memmap_tensor.tensor import MemoryMappedTensor
from shared_td.storage.slices import whole_storage

__all__ = ["ReadOnlyMemoryMappedTensor", "refuse_read_only"]

# Torch functions named like writes (``add_``, ``__iadd__``) that change no element.
_NOT_WRITES = frozenset({"requires_grad_", "detach_", "rename_", "share_memory_"})
# Writes whose names do not end in a single "_"; ``__set__`` is the ``.data = x`` setter.
_DUNDER_WRITES = frozenset({
    "__setitem__", "__set__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
    "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__",
    "__ixor__", "__ilshift__", "__irshift__",
})
# Results left as torch gives them: as_subclass asks for another class on purpose.
_NOT_REWRAPPED = frozenset({"as_subclass"})


class ReadOnlyMemoryMappedTensor(MemoryMappedTensor):
    """A MemoryMappedTensor over a file that this process may not write; writes raise.

    ``load_memmap`` of a save on a read-only file system, or with files this process may
    not write, gives these. The file is mapped privately (copy-on-write), so a write would
    change this process's copy only and be lost without a word; instead every torch write
    into it raises :class:`~shared_td.errors.ReadOnlyError` naming the file and why: an
    in-place op (``add_``, ``t += 1``, ``copy_``, ``fill_``..., and the aten overloads
    that write, ``torch.ops.aten.add_.Tensor``), ``t[i] = x``, ``out=t``,
    ``t.data = x``, and with them every in-place method of the tensordicts holding it.
    Views (indexing, ``view``, ``reshape``, ``unbind``, ``detach``...) stay read-only,
    also after pickling to another process; ``clone()`` and other ops give ordinary
    writable tensors, and ``numpy()`` a read-only array.

    Not covered (torch offers no hook): writes through ``untyped_storage()``, DLPack,
    or a view made with ``as_subclass(torch.Tensor)``; they change this process's copy
    only, never the file.

    Example:
        >>> import os, tempfile
        >>> from shared_td.storage import files
        >>> path = os.path.join(tempfile.mkdtemp(), "x.memmap")
        >>> _ = MemoryMappedTensor.from_tensor(torch.zeros(3), filename=path)
        >>> backing = files.open_file_backing(path, shared=False, read_only="it is an example")
        >>> t = MemoryMappedTensor._from_backing(backing, 0, torch.float32, (3,))
        >>> type(t[1:]).__name__, type(t + 1).__name__
        ('ReadOnlyMemoryMappedTensor', 'Tensor')
        >>> t.add_(1)
        Traceback (most recent call last):
        ...
        shared_td.errors.ReadOnlyError: Cannot write (add_) into a tensor of ... because it is an example. ...
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        name = getattr(func, "__name__", "")
        if name in _DUNDER_WRITES or (name[-1:] == "_" and name[-2:] != "__" and name not in _NOT_WRITES):
            # the written tensor is the first argument (a list of them for _foreach_ ops)
            refuse_read_only(args[0] if args else None, name)
        out = kwargs.get("out")
        if out is not None:
            refuse_read_only(out, name)
        if type(func) is _OP_OVERLOAD:  # torch.ops.aten.add_.Tensor: named "add_.Tensor"
            for position, keyword in _written_arguments(func):
                refuse_read_only(args[position] if position < len(args) else kwargs.get(keyword), name)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if name in _NOT_REWRAPPED:
            return result
        source = next((a for a in args if isinstance(a, ReadOnlyMemoryMappedTensor)), None)
        return _keep_read_only(result, source) if source is not None else result

    def _wrap(self, tensor: torch.Tensor):
        return tensor  # __torch_function__ made the views of our storage read-only already

    def _write_refused(self, operation: str) -> ReadOnlyError:
        backing = self._backing
        return ReadOnlyError(
            f"Cannot write ({operation}) into a tensor of {backing.path}: it is mapped "
            f"read-only because {backing.read_only}. A write would change this process's "
            "copy only, never the file. For a writable copy, use .clone() (td.clone() for "
            "a whole tensordict); to change the save, load it from a place this process "
            "may write."
        )


def refuse_read_only(target, operation: str) -> None:
    """Raise :class:`ReadOnlyError` if ``target`` (a tensor, or a list or tuple of them)
    is read-only: for writes of many tensors to check them all before the first."""
    if isinstance(target, ReadOnlyMemoryMappedTensor) and target._backing is not None:
        raise target._write_refused(operation)
    if isinstance(target, (list, tuple)):
        for item in target:
            refuse_read_only(item, operation)


_OP_OVERLOAD = torch._ops.OpOverload
_WRITTEN: dict = {}  # OpOverload -> its written arguments (see _written_arguments)


def _written_arguments(func) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of each argument that the aten op ``func`` writes into, by
    its schema (``Tensor(a!) self``, ``Tensor(a!) out``): its name may not end in "_".

    Example:
        >>> _written_arguments(torch.ops.aten.add_.Tensor), _written_arguments(torch.ops.aten.add.Tensor)
        (((0, 'self'),), ())
    """
    written = _WRITTEN.get(func)
    if written is None:
        written = _WRITTEN[func] = tuple(
            (position, argument.name) for position, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write)
    return written


def _keep_read_only(result, source: ReadOnlyMemoryMappedTensor):
    """``result`` of an op on ``source``, with every view of its storage read-only too."""
    if isinstance(result, torch.Tensor):
        backing = source._backing
        if (type(result) is not ReadOnlyMemoryMappedTensor and backing is not None
                and backing.storage is not None
                and whole_storage(result.untyped_storage())[0].data_ptr() == backing.storage.data_ptr()):
            result = result.as_subclass(ReadOnlyMemoryMappedTensor)
            result._backing = backing
            result._parent_shape = source._parent_shape
        return result
    if isinstance(result, (tuple, list)):
        return type(result)(_keep_read_only(item, source) for item in result)
    if isinstance(result, np.ndarray):  # numpy() views our bytes
        result.flags.writeable = False
    return result


_tensor.READ_ONLY_CLASS = ReadOnlyMemoryMappedTensor
