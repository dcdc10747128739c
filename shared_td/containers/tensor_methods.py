"""torch.Tensor's methods that a TensorDict applies to every tensor it holds: the copies
``clone``, ``contiguous`` and ``to`` (through ``TensorDict._map_entries``: nested
collections answer the same methods) and the in-place ``zero_``, ``fill_`` and
``share_memory_``.
"""
from __future__ import annotations

import errno
import os
from typing import TYPE_CHECKING, Any

import torch

from shared_td.containers.base import TensorDictBase, is_non_tensor, is_tensor_collection, on_cuda
from shared_td.containers.consolidation import moved_consolidated
from shared_td.containers.keysview import tensors_at
from shared_td.containers.shape_write_back import back_to_types_of, with_write_back
from shared_td.containers.to_args import copied_as_root, parse_to
from shared_td.containers.unpicklable import check_picklable, share_values_together
from shared_td.keys import NestedKey, key_repr, unravel_key
from shared_td.memmap_tensor import ReadOnlyMemoryMappedTensor, refuse_read_only
from shared_td.storage.fd_mapping import descriptor_limits
from shared_td.storage.slices import in_shared_mapping
from shared_td.tensorclass_protocol import unwrap_tensorclass

if TYPE_CHECKING:  # for the annotations only: tensordict.py imports this module
    from shared_td.containers.tensordict import TensorDict


class TensorMethods:
    """Mixin of TensorDict (it relies on ``_map_entries``, ``_batch_size``, ``_device``,
    ``_tensordict``, ``_leaf_tensors``, ``get`` and ``lock_``)."""

    # ---------------------------------------------------------------- copies
    def clone(self, recurse: bool = True) -> "TensorDict":
        """A copy; with ``recurse=False`` the tree's structure is copied (nested
        tensordicts, tensorclasses and non-tensor entries are new ones) but the tensors
        are the same, as tensordict 0.15.3's."""
        if not recurse:
            return self._map_entries(lambda v: v.clone(recurse=False) if is_tensor_collection(v) else v,
                                     self._batch_size, self.names)
        return self._map_entries(
            lambda v: v.clone() if isinstance(v, (torch.Tensor, TensorDictBase)) or is_tensor_collection(v) else v,
            self._batch_size,
            self.names,
        )

    def contiguous(self) -> "TensorDict":
        """A copy whose tensors are contiguous, plain (not memory-mapped) tensors."""
        return self._map_entries(_plain_contiguous, self._batch_size, self.names)

    def to(self, *args: Any, **kwargs: Any) -> "TensorDict":
        """Move to a device (``td.to("cpu")``), cast tensors (``td.to(torch.float16)``),
        or both (``td.to("cpu", torch.float16)``, ``td.to(device=..., dtype=...)``): the
        arguments of ``torch.Tensor.to``, read as torch reads them (one it refuses raises).

        A consolidated tensordict (see ``consolidate()``) moves as ONE copy of its
        storage, its leaves views of the copy; the result is consolidated there and
        locked, as in tensordict. Others move leaf by leaf.

        ``inplace=True`` (as in tensordict 0.15.3) makes self's leaves the moved or cast
        ones and returns self, its nested tensordicts kept; a locked tensordict refuses
        it (a LockedTensorDictError) unless nothing changes."""
        if kwargs.pop("inplace", False):
            converted = self.to(*args, **kwargs)
            if converted is not self:
                self._check_unlocked((), "replace its leaves with to(..., inplace=True)")
                _adopt_entries(self, converted)
            return self
        device, dtype, asked = parse_to(args, kwargs, self._batch_size)  # (both of to(device, dtype), as torch reads them)
        with copied_as_root(self, []) as result:  # (locked as self: see copied_as_root)
            moved = self if device is None else self._moved(device, asked)
            result.append(moved if dtype is None else
                          moved._map_entries(lambda v: v.to(dtype), moved._batch_size, moved.names))
        # leaving `with td.to(...) as t:` writes t back into td, on td's devices and dtypes
        return with_write_back(self, result[0], back_to_types_of(self, dtype is not None))

    def _moved(self, device: torch.device, asked: bool) -> "TensorDict":
        """``to(device)`` (``asked``: non_blocking was given)."""
        if device == self._device:
            return self
        moved = moved_consolidated(self, device, asked)
        if moved is not None:
            return moved
        # To or from a GPU, each leaf's copy is queued (non_blocking) and the GPU waited
        # for once at the end, as tensordict does: a blocking copy per leaf waits for each
        # in turn (a 2000-leaf tree took 1.8x tensordict's time). A caller that asked for
        # non_blocking waits itself. Only for a move that involves a CUDA device: the
        # wait is for the whole device, which a move between CPU devices must not do.
        queued = asked or on_cuda(device) or on_cuda(self._device)
        result = self._map_entries(
            lambda v: v.to(device, non_blocking=True) if queued else v.to(device),
            self._batch_size, self.names, device=device)
        if queued and not asked:
            torch.cuda.synchronize(device if on_cuda(device) else self._device)
        return result

    # ---------------------------------------------------------------- in-place ops
    def zero_(self) -> "TensorDict":
        """Fill every tensor with zeros, in place; returns self.

        Raises:
            ReadOnlyError: if a tensor is mapped read-only (``load_memmap(..., mode="r")``,
                a nested lazy stack's member too), before any tensor is written.
        """
        leaves = list(self._leaf_tensors())
        refuse_read_only(leaves, "zero_")  # (all before the first write, as set_at_)
        for leaf in leaves:
            leaf.zero_()
        return self

    def fill_(self, key: NestedKey, value: Any) -> "TensorDict":
        """Fill the entry ``key`` (a tensor, or every tensor of a nested tensordict) with
        ``value``, in place; returns self.

        Raises:
            KeyError: if ``key`` is missing (a KeyThroughLeafError when a part of it holds
                a tensor or non-tensor value, as tensordict). ReadOnlyError: if a tensor
                to fill is mapped read-only, before any is written.
        """
        return fill_entry(self, key, value)

    def share_memory_(self) -> "TensorDict":
        """Move every tensor to shared memory (torch's), and every non-tensor value into
        a cell shared between processes, then lock; returns self.

        A tensordict whose device is CUDA is returned as it is, not locked: CUDA tensors
        are shared between processes already (``is_shared()`` is True), as in tensordict.

        As in tensordict, a process that receives the tensordict (fork, spawn, a queue)
        and writes a non-tensor entry in place (``set_``, ``update_``, ``td[i] = ...``)
        is seen by every other: ``td.set_("task", "run")`` in a child changes the
        parent's ``td["task"]``. A receiving process attaches to a cell through the
        process that shared it, so that process must still be alive then.

        Raises:
            RuntimeError: if the tensordict is memory-mapped (the two are exclusive).
            TypeError: naming its nested key, if a non-tensor value cannot be pickled
                (checked before anything is shared).
            OSError: EMFILE or ENFILE naming the key and the limit, when this process is
                out of file descriptors (torch's shared memory keeps one open per
                tensor): the tensors before that key are shared already, the tree is
                not marked shared nor locked, and a call once descriptors are free
                completes it.
        """
        if self._is_memmap:
            raise RuntimeError(
                "memmap and shared memory are mutually exclusive features: this "
                "tensordict is memory-mapped already (its leaves are shared)."
            )
        if on_cuda(self._device):
            return self
        # the whole tree checked, and its values put in cells, once, here: before any value
        # is put in a cell (nothing done on refusal), and not again by each nested node
        refuse_mapped_nodes(self._collection_children(), "a tensordict nested in this one")
        check_picklable(self, "share_memory_()", shared=True)
        share_values_together(self)  # (then found shared below)
        self._share_checked_nodes()
        return self

    def _share_checked_nodes(self, path: tuple = ()) -> None:
        """share_memory_() of this node (at ``path`` below the root) and those below it,
        once the tree was checked and its values put in cells at its root: each node
        shared, then locked."""
        for key, value in self._tensordict.items():
            if isinstance(value, torch.Tensor) and value.layout is torch.strided and \
                    in_shared_mapping(value.untyped_storage()):
                continue  # a plain view of a segment or shared file: shared already (torch would copy it)
            if isinstance(value, torch.Tensor):
                try:
                    value.share_memory_()
                except RuntimeError as error:
                    raise _out_of_descriptors(error, path + (key,)) or error
            elif is_non_tensor(value):
                value.share_memory_()
            elif is_tensor_collection(value):
                share_checked(value, path + (key,))
        self._is_shared = True
        self.lock_()


def _out_of_descriptors(error: RuntimeError, path: tuple) -> OSError | None:
    """torch's RuntimeError for a tensor at ``path`` that could not be moved to shared
    memory for want of a file descriptor (torch keeps one open per shared tensor), as an
    OSError naming the key and the limit; None for any other error."""
    for code in (errno.ENFILE, errno.EMFILE):  # (EMFILE's words begin ENFILE's: that one first)
        if f"{os.strerror(code)} ({code})" in str(error):
            return OSError(code, f"share_memory_(): the tensor at {key_repr(path)} could not be moved to shared "
                                 f"memory: {descriptor_limits(code)} The tensors before it are shared already (the "
                                 "nested tensordicts completed before it marked shared and locked); its tensordict "
                                 "and those above it are neither: call share_memory_() again once descriptors are "
                                 "free (or share one anonymous segment for the whole tree: memmap_() without a "
                                 "prefix).")
    return None


def share_checked(node: Any, path: tuple = ()) -> None:
    """``node.share_memory_()`` for a tensordict (at ``path``) below a root whose
    share_memory_() has checked the whole tree and put its values in cells: a TensorDict
    is not checked again (each nesting level walked its whole subtree again); a CUDA one,
    a tensorclass or a lazy stack shares as it does alone."""
    if isinstance(node, TensorMethods) and not on_cuda(node._device):
        node._share_checked_nodes(path)
    else:
        node.share_memory_()


def refuse_mapped_nodes(nodes: list, which: str) -> None:
    """The RuntimeError of ``share_memory_()`` if one of ``nodes`` (tensordicts,
    tensorclasses), or a tensordict nested in one at any depth, is memory-mapped
    (``which`` says where it was looked for), raised before anything is shared: the
    values of the whole tree are put in cells first (share_values_together), so a
    refusal met on the way down left values of the tree, those of the mapped node too,
    in cells that every process receiving them then wrote through, while
    ``is_shared()`` read False."""
    pending = list(nodes)
    while pending:
        node = unwrap_tensorclass(pending.pop())
        if is_non_tensor(node):
            continue
        if getattr(node, "_is_memmap", False):
            raise RuntimeError(
                f"memmap and shared memory are mutually exclusive features: {which} is "
                "memory-mapped already."
            )
        pending += node._collection_children()


def fill_entry(td: Any, key: NestedKey, value: Any) -> Any:
    """``td.fill_(key, value)`` of a TensorDict or a lazy stack (see TensorDict.fill_):
    every tensor to fill found first, a read-only one refused before any is written."""
    path = unravel_key(key)
    try:
        targets = list(tensors_at(td, path))
    except KeyError:
        raise td._missing_key_error(path) from None
    refuse_read_only(targets, "fill_")
    for leaf in targets:
        leaf.fill_(value)
    return td


def _adopt_entries(target: Any, source: Any) -> None:
    """Make ``target``'s entries those of ``source`` (``target.to(...)``), keeping each
    nested tensordict of target's class and filling it in turn."""
    entries = {}
    for key, value in source._tensordict.items():
        mine = target._tensordict.get(key)
        if type(mine) is type(value) and isinstance(value, TensorMethods):
            _adopt_entries(mine, value)
            value = mine
        entries[key] = value
    target._tensordict = entries
    target._device = source._device


def _plain_contiguous(value: Any) -> Any:
    if isinstance(value, ReadOnlyMemoryMappedTensor):  # a copy: a view would be writable
        return value.clone(memory_format=torch.contiguous_format)
    if isinstance(value, torch.Tensor):
        return value.as_subclass(torch.Tensor).contiguous() if type(value) is not torch.Tensor else value.contiguous()
    return value.contiguous()
