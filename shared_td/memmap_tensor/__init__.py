"""MemoryMappedTensor: a CPU tensor whose bytes live in a file or an anonymous segment.

Design (differences from tensordict 0.15.3 are marked *ours*):

* Every MemoryMappedTensor (MMT) views the single uint8 storage of its *backing*: a
  :class:`~shared_td.storage.files.FileBacking` (a whole mapped file) or a
  :class:`~shared_td.storage.anonymous.Segment` (a memfd). The backing is a Python
  attribute, ``_backing``; views made by indexing share it.
* Because a view and its backing share one storage, a tensor pickles as ``(backing,
  dtype, size, stride, byte offset)``: no index bookkeeping, so views of views stay
  exact after pickling (*ours*: tensordict pickles ``t[2:5][0]`` as ``t[0]``).
* Torch-function dispatch is disabled, so ordinary ops return plain tensors and in-place
  ops return the MMT itself; indexing, ``unbind``, ``split`` and ``chunk`` re-wrap results
  that still share the storage.
* Zero-element tensors map nothing and create no file; they pickle as an empty tensor
  (with their filename, if any).
* A tensor over a file this process may not write (a read-only file system, the file's
  mode) is a :class:`ReadOnlyMemoryMappedTensor`: its mapping is private and every torch
  write into it raises :class:`~shared_td.errors.ReadOnlyError` (*ours*: tensordict lets
  the write change this process's copy only). Only that subclass checks: writable
  tensors keep the disabled dispatch and pay nothing.
"""

from __future__ import annotations

import multiprocessing.reduction

from shared_td.memmap_tensor.read_only import ReadOnlyMemoryMappedTensor, refuse_read_only
from shared_td.memmap_tensor.shapes import checked_shape
from shared_td.memmap_tensor.tensor import MemoryMappedTensor, _reduce

__all__ = ["MemoryMappedTensor", "ReadOnlyMemoryMappedTensor", "checked_shape", "refuse_read_only"]

# Queues and process arguments use ForkingPickler, whose dispatch table would otherwise
# not know our type; multiprocess (dill) has its own ForkingPickler.
for _class in (MemoryMappedTensor, ReadOnlyMemoryMappedTensor):
    multiprocessing.reduction.ForkingPickler.register(_class, _reduce)
try:
    import multiprocess.reduction
except ImportError:  # optional: __reduce_ex__ alone also works with dill
    pass
else:
    for _class in (MemoryMappedTensor, ReadOnlyMemoryMappedTensor):
        multiprocess.reduction.ForkingPickler.register(_class, _reduce)
