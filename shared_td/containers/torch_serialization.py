"""``torch.load`` with torch's default ``weights_only=True`` loads our containers.

Since torch 2.6, ``torch.load(path)`` unpickles with a restricted unpickler that rebuilds
only tensors, plain data and the globals listed with
``torch.serialization.add_safe_globals``. tensordict 0.15.3 lists its containers when it
is imported; this module lists ours, the smallest set that a saved TensorDict, lazy
stack or non-tensor entry names: the classes TensorDict, LazyStackedTensorDict,
NonTensorData and NonTensorStack, which are rebuilt from their state (``__setstate__``
sets attributes and re-locks: no file, no import, no call of anything the pickle names).

Not a consolidated tree: its pickle names ``_unpickle_consolidated``, which unpickles
the tree's skeleton with an unpickler of its own that resolves no global but does
build objects (BUILD, REDUCE) as any unpickler does; allowlisted, it let a crafted file
set attributes on any class that the outer unpickler let through (a file setting
``torch.UntypedStorage.nbytes`` broke every later ``torch.save`` of the process), which
``weights_only=True`` promises cannot happen. Load a consolidated tree with
``weights_only=False`` (a file you trust) or save it with ``memmap()``/``save()``.

Left off, as tensordict leaves its own off: MemoryMappedTensor, its file backing and
anonymous segments, shared non-tensor values and SharedCounter, which open files or
reopen other processes' descriptors on loading; the user's tensorclasses and the types
of other non-tensor values (allowlist them with ``torch.serialization.add_safe_globals``
or load with ``weights_only=False``, for a file you trust).

Example:
    >>> import io, torch
    >>> from shared_td import TensorDict
    >>> file = io.BytesIO()
    >>> torch.save(TensorDict(a=torch.zeros(2), batch_size=[2]).lock_(), file)
    >>> _ = file.seek(0)
    >>> loaded = torch.load(file)   # weights_only=True
    >>> loaded.batch_size, loaded.is_locked
    (torch.Size([2]), True)
"""
from __future__ import annotations

import torch

from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.tensordict import TensorDict

SAFE_GLOBALS = (TensorDict, LazyStackedTensorDict, NonTensorData, NonTensorStack)

torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
