"""shared_td: share nested dictionaries of tensors between the processes of one machine.

The public names mirror tensordict 0.15.3, so code written for tensordict runs after
changing its import.

Linux only: importing shared_td on any other system, or on a Linux without what it needs
(memfd_create, /proc, open-file-description locks), raises one ImportError that names
what is missing (see :mod:`shared_td.platform`).
"""
import shared_td.platform  # noqa: F401  (first: the one check of the platform)
from shared_td.cli.startup import quiet_interrupt_while_starting

quiet_interrupt_while_starting()  # (before torch: a Ctrl-C of `shared-td ...` while it loads is one line)
from shared_td.containers.base import (
    TensorDictBase,
    default_is_leaf,
    is_leaf_nontensor,
    is_non_tensor,
    is_tensor_collection,
)
from shared_td.containers.consolidated_load import from_consolidated
from shared_td.containers.functional import assert_allclose_td, assert_close, dense_stack_tds, merge_tensordicts
from shared_td.containers.functional_pad import pad, pad_sequence
from shared_td.containers.extra_constructors import cat, fromkeys, make_tensordict, maybe_dense_stack, stack
from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.containers.nontensor import NonTensorData, NonTensorDataBase, NonTensorStack
from shared_td.containers.nontensor_options import (capture_non_tensor_stack, list_to_stack,
                                                     set_capture_non_tensor_stack, set_list_to_stack)
from shared_td.containers.tensorclass import TensorClass, from_dataclass, is_tensorclass, tensorclass
from shared_td.containers.tensordict import TensorDict
from shared_td.coordinator import Coordinator, attach, is_stale, refresh, version, wait_version
from shared_td.keys import NestedKey
from shared_td.keys import canonical_key as unravel_key, unravel_key_list, unravel_key_to_tuple
from shared_td.errors import (
    AtomicWriteError,
    BatchDimError,
    TransposeDimError,
    BatchSizeMismatchError,
    ArgumentGivenTwiceError,
    ClusterAuthError,
    CoordinatorAuthenticationError,
    CoordinatorTimeoutError,
    DemoNodeStoppedError,
    FileReplacedError,
    MappingError,
    FileTooShortError,
    FormatError,
    IndexTypeError,
    InPlaceKindError,
    InPlaceWriteError,
    KeyThroughLeafError,
    KeyTypeError,
    LockedTensorDictError,
    NameClashError,
    NodeTakenOverError,
    WorkerDiedError,
    WorkerTraceback,
    NotASaveError,
    OwnerLostError,
    ReadOnlyError,
    SaveChangedError,
    SegmentUnavailableError,
    SplitSizeError,
    StateDictKeysError,
    StorageFullError,
    StalePair,
    TransferFailed,
    TransferRefused,
    UnstorableValueError,
)
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist.append import append_memmap
from shared_td.persist.archive import is_memmap_archive
from shared_td.persist.archive_checksums import refresh_archive_checksums
from shared_td.persist.archive_write import pack_memmap, unpack_memmap
from shared_td.persist.atomic import gc
from shared_td.persist.functions import load, load_memmap, memmap, save
from shared_td.persist.future import TensorDictFuture
from shared_td.storage.counter import SharedCounter

__version__ = "0.1.0"

#: ``lazy_stack(tds, dim=0)``, as ``tensordict.lazy_stack``
lazy_stack = LazyStackedTensorDict.lazy_stack

__all__ = [
    "AtomicWriteError",
    "BatchDimError",
    "TransposeDimError",
    "BatchSizeMismatchError",
    "ClusterAuthError",
    "Coordinator",
    "CoordinatorAuthenticationError",
    "CoordinatorTimeoutError",
    "FileTooShortError",
    "FormatError",
    "IndexTypeError",
    "InPlaceKindError",
    "InPlaceWriteError",
    "KeyThroughLeafError",
    "NameClashError",
    "ArgumentGivenTwiceError",
    "KeyTypeError",
    "LazyStackedTensorDict",
    "LockedTensorDictError",
    "MemoryMappedTensor",
    "NestedKey",
    "NodeTakenOverError",
    "WorkerDiedError",
    "WorkerTraceback",
    "DemoNodeStoppedError",
    "NotASaveError",
    "ReadOnlyError",
    "NonTensorData",
    "NonTensorDataBase",
    "NonTensorStack",
    "OwnerLostError",
    "FileReplacedError",
    "MappingError",
    "SaveChangedError",
    "SegmentUnavailableError",
    "SplitSizeError",
    "StateDictKeysError",
    "SharedCounter",
    "StorageFullError",
    "TensorClass",
    "TensorDict",
    "TensorDictBase",
    "TensorDictFuture",
    "StalePair",
    "TransferFailed",
    "TransferRefused",
    "UnstorableValueError",
    "assert_allclose_td",
    "assert_close",
    "attach",
    "cat",
    "default_is_leaf",
    "dense_stack_tds",
    "capture_non_tensor_stack",
    "from_dataclass",
    "list_to_stack",
    "set_capture_non_tensor_stack",
    "set_list_to_stack",
    "fromkeys",
    "gc",
    "append_memmap",
    "is_leaf_nontensor",
    "is_memmap_archive",
    "is_non_tensor",
    "is_stale",
    "is_tensor_collection",
    "is_tensorclass",
    "lazy_stack",
    "make_tensordict",
    "maybe_dense_stack",
    "from_consolidated",
    "load",
    "load_memmap",
    "memmap",
    "merge_tensordicts",
    "pad",
    "pad_sequence",
    "pack_memmap",
    "refresh",
    "refresh_archive_checksums",
    "save",
    "stack",
    "tensorclass",
    "unpack_memmap",
    "unravel_key",
    "unravel_key_list",
    "unravel_key_to_tuple",
    "version",
    "wait_version",
]
