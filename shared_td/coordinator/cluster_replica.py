"""What travels between nodes: a tensordict's layout as plain JSON, and replica segments.

A replicated name is a tensordict whose tensor leaves all lie in ONE anonymous segment
(what ``memmap_()`` without a prefix makes: :func:`shared_td.persist.writer` packs a tree
into one segment). Its *layout* -- batch size, and for each leaf its key, dtype, shape and
byte offset, and the key and batch size of each shared NonTensorData value (whose
contents travel separately, see :mod:`~shared_td.coordinator.cluster_values`) -- is plain
JSON in the store, so another node rebuilds the same tree over a
segment of its own, and a transfer is one contiguous copy of ``nbytes`` bytes, received
in place.

A replica segment is ``nbytes`` data bytes followed by a 64-byte trailer: a magic word and
a *state* word, ``2 * version`` when the data is one complete version, odd while a
transfer writes it. Every process of the node that attached the replica reads the version
from its own mapping (:func:`version`, :func:`wait_version`, exported as
``shared_td.version`` and ``shared_td.wait_version``), without asking anyone.

What is not replicated is refused with a TypeError naming the leaf: tensorclasses, lazy
stacks, and NonTensorData/NonTensorStack values of a name published without
``share_non_tensor=True``.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.tensordict import TensorDict
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.storage.anonymous import Segment

__all__ = ["Owned", "Replica", "check_kinds", "describe", "leaf_views", "pack_rows", "rebuild", "replica_version",
           "segment_bytes", "unpack_rows", "value_cells", "version", "wait_version"]

_TRAILER = 64
_MAGIC = 0x5348545F5245504C  # "SHT_REPL"


@dataclass
class Owned:
    """A name this node owns: its tensordict, segment, layout, generation and sync count."""

    td: object
    segment: Segment
    layout: dict
    generation: int
    version: int
    leaves: list = field(default_factory=list)  # leaf_views(segment, layout), made by the first push


@dataclass
class Replica:
    """This node's replica of a name another node owns; ``lock`` orders its transfers."""

    td: object
    segment: Segment
    layout: dict
    owner: int
    generation: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    leaves: list = field(default_factory=list)  # leaf_views(segment, layout), made by the first push


# The non-tensor containers that replicate, by name: each from the payload of its shared
# cell (one value; a stack's flat list of values in C order) and its batch size.
_VALUE_CLASSES = {
    "NonTensorData": lambda value, batch_size: NonTensorData(value, batch_size=batch_size),
    "NonTensorStack": lambda values, batch_size: NonTensorStack._from_flat(values, torch.Size(batch_size)),
}


def _is_leaf_here(cls: type) -> bool:
    # walk into TensorDict nodes only: anything else (a tensor, a non-tensor value, a
    # tensorclass, a lazy stack) is a leaf of the layout, checked by _segment_of
    return not issubclass(cls, TensorDict)


def check_kinds(td, name: str, share_non_tensor: bool) -> None:
    """TypeError, naming the leaf, for what does not replicate (checked before anything
    is memory-mapped or published): a root that is not a TensorDict; leaves other than
    tensors, NonTensorData and NonTensorStack; those two without ``share_non_tensor=True``."""
    if type(td) is not TensorDict:
        raise TypeError(f"{name!r}: only a TensorDict can be replicated, not a {type(td).__name__}.")
    for key, leaf in _leaves(td):
        if type(leaf) in (NonTensorData, NonTensorStack):
            if not share_non_tensor:
                raise TypeError(
                    f"{name!r}: the leaf {key} is a non-tensor value; a replicated name shares "
                    "its non-tensor values across the cluster only when published with "
                    "share_non_tensor=True (publish(name, td, replicate=True, share_non_tensor=True))."
                )
        elif not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{name!r}: the leaf {key} is a {type(leaf).__name__}; a replicated name holds "
                "TensorDict nodes, tensors, NonTensorData and NonTensorStack values only (publish the others "
                "under a name that is not replicated)."
            )


def _leaves(td):
    for key, leaf in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_here):
        yield ((key,) if isinstance(key, str) else tuple(key)), leaf


def _segment_of(td, name: str, share_non_tensor: bool) -> tuple[Segment, list, list]:
    check_kinds(td, name, share_non_tensor)
    leaves, values, segment = [], [], None
    for key, leaf in _leaves(td):
        if type(leaf) in (NonTensorData, NonTensorStack):
            values.append((key, leaf))
            continue
        backing = getattr(leaf, "_backing", None)
        if leaf.numel() and not isinstance(backing, Segment):
            raise ValueError(
                f"{name!r}: the leaf {key} is not in anonymous shared memory; publish with "
                "replicate=True without a prefix, so that the whole tree lies in one segment."
            )
        if leaf.numel() and segment is not None and backing is not segment:
            raise ValueError(
                f"{name!r}: the leaves lie in several segments; replicate a tensordict made "
                "by one memmap_() without a prefix."
            )
        if leaf.numel() and not leaf.is_contiguous():
            raise ValueError(f"{name!r}: the leaf {key} is not contiguous.")
        segment = backing if leaf.numel() else segment
        leaves.append((key, leaf))
    return segment, leaves, values


def describe(td, name: str, share_non_tensor: bool = False) -> tuple[dict, Segment, list]:
    """The JSON layout of ``td`` (one segment of tensor leaves, and NonTensorData and
    NonTensorStack values shared with ``share_non_tensor=True``), its segment and the cells of its values (in
    the order of ``layout["values"]``)."""
    segment, leaves, values = _segment_of(td, name, share_non_tensor)
    if segment is None:
        raise ValueError(f"{name!r}: nothing to replicate (no tensor with elements).")
    return {
        "batch_size": list(td.batch_size),
        "nbytes": segment.nbytes,
        "leaves": [
            {"key": list(key), "dtype": str(leaf.dtype).removeprefix("torch."),
             "shape": list(leaf.shape), "offset": leaf._byte_offset() if leaf.numel() else 0}
            for key, leaf in leaves
        ],
        "values": [{"key": list(key), "class": type(leaf).__name__, "batch_size": list(leaf.batch_size)}
                   for key, leaf in values],
    }, segment, [leaf._shared_value for _key, leaf in values]


def rebuild(layout: dict, values: list) -> tuple[TensorDict, Segment]:
    """A new replica: a segment of ``nbytes`` + trailer, state 0 (no version yet), and a
    TensorDict over it with the owner's keys, dtypes, shapes and offsets, and its
    non-tensor ``values`` (not shared yet: ``memmap_(share_non_tensor=True)`` does it)."""
    segment = Segment.create(layout["nbytes"] + _TRAILER)
    _words(segment)[0] = _MAGIC
    td = TensorDict({}, batch_size=layout["batch_size"])
    for leaf in layout["leaves"]:
        dtype = getattr(torch, leaf["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"The layout names an unknown dtype {leaf['dtype']!r}.")
        td.set(tuple(leaf["key"]), MemoryMappedTensor._from_backing(segment, leaf["offset"], dtype, leaf["shape"]))
    for entry, value in zip(layout.get("values", ()), values):
        td.set(tuple(entry["key"]), _VALUE_CLASSES[entry["class"]](value, entry["batch_size"]))
    return td, segment


def value_cells(td, layout: dict) -> list:
    """The shared cells of the non-tensor values of ``td`` listed in ``layout``."""
    return [td.get(tuple(entry["key"]))._shared_value for entry in layout.get("values", ())]


def segment_bytes(segment: Segment, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``segment`` as one uint8 tensor over its memory."""
    return torch.empty(0, dtype=torch.uint8).set_(segment.storage, 0, (nbytes,))


def leaf_views(segment: Segment, layout: dict) -> list[torch.Tensor]:
    """The tensor leaves of ``layout`` as plain tensors over ``segment`` (in the order of
    ``layout["leaves"]``): the rows a push copies, without the per-call cost of the
    tensordict's lookups and of MemoryMappedTensor's dispatch."""
    data = segment_bytes(segment, layout["nbytes"])
    views = []
    for leaf in layout["leaves"]:
        dtype = getattr(torch, leaf["dtype"])
        count = 1
        for size in leaf["shape"]:
            count *= size
        start = leaf["offset"]
        views.append(data[start: start + count * dtype.itemsize].view(dtype).view(leaf["shape"]))
    return views


def pack_rows(leaves: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """One message for a push: ``index`` (int64), then leaf after leaf its rows ``index``
    (each copied once, straight into the message; ``leaves`` from :func:`leaf_views`)."""
    rows = int(index.numel())
    sizes = [rows * leaf[0].numel() * leaf.element_size() for leaf in leaves]
    payload = torch.empty(8 * rows + sum(sizes), dtype=torch.uint8)
    payload[: 8 * rows].view(torch.int64).copy_(index)
    offset = 8 * rows
    for leaf, size in zip(leaves, sizes):
        out = payload[offset: offset + size]
        if offset % leaf.element_size():  # rows of a smaller dtype came before: not aligned
            out.copy_(leaf.index_select(0, index).reshape(-1).view(torch.uint8))
        else:
            torch.index_select(leaf, 0, index, out=out.view(leaf.dtype).view((rows, *leaf.shape[1:])))
        offset += size
    return payload


def unpack_rows(leaves: list[torch.Tensor], message: torch.Tensor, rows: int) -> None:
    """Write the ``rows`` rows of a :func:`pack_rows` message into ``leaves``."""
    index = message[: 8 * rows].view(torch.int64)
    offset = 8 * rows
    for target in leaves:
        size = rows * target[0].numel() * target.element_size()
        chunk = message[offset: offset + size]
        if offset % target.element_size():
            chunk = chunk.clone()  # rows of a smaller dtype came before: realign
        target.index_copy_(0, index, chunk.view(target.dtype).view((rows, *target.shape[1:])))
        offset += size


def _words(segment: Segment) -> torch.Tensor:
    start = (segment.nbytes - _TRAILER) // 8
    return torch.empty(0, dtype=torch.int64).set_(segment.storage, start, (2,))


def state(segment: Segment) -> int:
    """The state word of a replica segment: 2 * version, odd while being written."""
    return int(_words(segment)[1])


def set_state(segment: Segment, state: int) -> None:
    _words(segment)[1] = state


def _replica_segment(td) -> Segment:
    for _key, leaf in td.items(include_nested=True, leaves_only=True):
        backing = getattr(leaf, "_backing", None)
        if isinstance(backing, Segment) and backing.nbytes > _TRAILER and int(_words(backing)[0]) == _MAGIC:
            return backing
    raise ValueError("This tensordict is not a replica of a name published on another node "
                     "(on the owner's node the data is written in place: there is no version to "
                     "wait for; coord.version(name) gives the owner's sync count).")


def version(td) -> int | None:
    """The version of the contents of the replica ``td`` (exported as
    ``shared_td.version``): the owner's ``sync`` count, read from the replica's own
    memory by any process of its node (no round trip); None while a transfer writes it
    (its rows may then mix two versions) or before the first one.

    Raises:
        ValueError: ``td`` is not a replica of a name owned by another node (on the
            owner's node the data is written in place: there is no transfer to wait for).

    Example (``view`` attached on node 1 of a name that node 0 owns)::

        >>> shared_td.version(view)                    # doctest: +SKIP
        3
    """
    state = int(_words(_replica_segment(td))[1])
    return None if state % 2 or state == 0 else state // 2


replica_version = version  # the name the cluster layer and its tests use


def wait_version(td, version: int, timeout: float = 10.0) -> int:
    """Wait until the replica ``td`` holds a complete version >= ``version`` and return
    it (exported as ``shared_td.wait_version``): after it, a read sees one whole
    version, until the next transfer starts. Polls the replica's own memory (10 µs at
    first, 5 ms at most between looks). TimeoutError after ``timeout`` seconds; ValueError
    if ``td`` is not a replica (see :func:`version`).

    Example::

        >>> shared_td.wait_version(view, 4, timeout=5.0)   # doctest: +SKIP
        4
    """
    words = _words(_replica_segment(td))
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while True:
        state = int(words[1])
        if state and state % 2 == 0 and state // 2 >= version:
            return state // 2
        if time.monotonic() > deadline:
            raise TimeoutError(f"The replica did not reach version {version} within {timeout:g} s "
                               f"(it holds {state // 2}{', being written' if state % 2 else ''}).")
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
