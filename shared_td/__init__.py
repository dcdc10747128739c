"""shared_td: share nested dictionaries of tensors between the processes of one machine.

The public names mirror tensordict 0.15.3, so code written for tensordict runs after
changing its import.
"""
from shared_td.containers.base import TensorDictBase, is_non_tensor, is_tensor_collection
from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.tensorclass import is_tensorclass, tensorclass
from shared_td.containers.tensordict import TensorDict
from shared_td.coordinator import Coordinator, attach, is_stale, refresh
from shared_td.errors import BatchSizeMismatchError, KeyTypeError, LockedTensorDictError
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist.atomic import gc
from shared_td.persist.functions import load, load_memmap, memmap, save
from shared_td.persist.future import TensorDictFuture
from shared_td.storage.counter import SharedCounter

__version__ = "0.1.0"

__all__ = [
    "BatchSizeMismatchError",
    "Coordinator",
    "KeyTypeError",
    "LazyStackedTensorDict",
    "LockedTensorDictError",
    "MemoryMappedTensor",
    "NonTensorData",
    "NonTensorStack",
    "SharedCounter",
    "TensorDict",
    "TensorDictBase",
    "TensorDictFuture",
    "attach",
    "gc",
    "is_non_tensor",
    "is_stale",
    "is_tensor_collection",
    "is_tensorclass",
    "load",
    "load_memmap",
    "memmap",
    "refresh",
    "save",
    "tensorclass",
]
