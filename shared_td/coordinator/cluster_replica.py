"""Replica segments, their versions, and the rows of a push.

A replicated name is a tree whose tensor leaves all lie in ONE anonymous segment; its
*layout* (:mod:`~shared_td.coordinator.cluster_layout`) tells another node how to rebuild
the same tree over a segment of its own, so a transfer is one contiguous copy of
``nbytes`` bytes, received in place.

A replica segment is ``nbytes`` data bytes followed by a 64-byte trailer: a magic word and
a *state* word, ``2 * version`` when the data is one complete version, odd while a
transfer writes it. A version counts the owner's deliveries of the name: the publish is
1, and each sync and each pull it serves (a replica's ``pull``, first attach or renew)
takes the next one, so each number a replica holds labels one delivery and only grows
(``cluster_sync.NameSyncs``). Every process of the node that attached the replica reads the version
from its own mapping (:func:`version`, :func:`wait_version`, exported as
``shared_td.version`` and ``shared_td.wait_version``), without asking anyone.

A push sends *rows*: indices along the root's first batch dimension, as ``td[index]``
selects them. Of a leaf below TensorDicts and tensorclasses, its rows ``index`` (its own
first dimension); below a lazy stack stacked along that dimension (``stack_dim=0``), a
row is a whole member, so each leaf of member ``m`` is sent whole when ``m`` is in
``index``; a lazy stack stacked along another dimension has the same rows in every member.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from shared_td.coordinator.cluster_layout import tensor_leaves
from shared_td.platform import ThreadLock
from shared_td.storage.anonymous import Segment

__all__ = ["Owned", "Replica", "forget_replica", "leaf_views", "new_segment", "pack_rows", "record_replica",
           "replica_version", "segment_bytes", "unpack_rows", "version", "wait_version"]

_TRAILER = 64
_MAGIC = 0x5348545F5245504C  # "SHT_REPL"


@dataclass
class Owned:
    """A name this node owns: its tensordict, segment, layout, generation and the version of
    its last delivery (see the module's opening)."""

    td: object
    segment: Segment
    layout: dict
    generation: int
    version: int
    leaves: list = field(default_factory=list)  # leaf_views(segment, layout), made by the first push
    digest: str = ""  # the publish's identity, with the generation (see cluster_generations)


@dataclass
class Replica:
    """This node's replica of a name another node owns; ``lock`` orders its transfers
    and a push's reading of its rows.

    Its segment's state word is 0 until a transfer filled it once (the Cluster
    registers a replica only then: a push of an unfilled one sent zeros nobody wrote
    into the owner's data).
    ``renewed_from``: the generation of the replica this one replaced on its owner's
    renew notice, until a call of ``attach`` in this process returns it (0: none): the
    rows the user wrote are in views of that generation, so a push of this one is
    refused (it would send the owner's own new values in their place)."""

    td: object
    segment: Segment
    layout: dict
    owner: int
    generation: int
    lock: ThreadLock = field(default_factory=ThreadLock)
    leaves: list = field(default_factory=list)  # leaf_views(segment, layout), made by the first push
    renewed_from: int = 0
    digest: str = ""  # the publish's identity, with the generation (see cluster_generations)


def new_segment(nbytes: int) -> Segment:
    """A replica segment: ``nbytes`` data bytes and the trailer, state 0 (no version yet)."""
    segment = Segment.create(nbytes + _TRAILER)
    _words(segment)[0] = _MAGIC
    return segment


def segment_bytes(segment: Segment, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``segment`` as one uint8 tensor over its memory."""
    return torch.empty(0, dtype=torch.uint8).set_(segment.storage, 0, (nbytes,))


def leaf_views(segment: Segment, layout: dict) -> list[tuple[torch.Tensor, int | None, int]]:
    """The tensor leaves of ``layout`` as plain tensors over ``segment`` (in the order of
    ``layout["leaves"]``), each with its row (None: the leaf's first dimension holds the
    rows; an int: the whole leaf is that row, see the module doc) and the bytes a message
    carries of it per row (None) or whole (an int): what a push copies, without the
    per-call cost of the tree's lookups and of MemoryMappedTensor's dispatch."""
    data = segment_bytes(segment, layout["nbytes"])
    views = []
    for leaf in layout["leaves"]:
        dtype = getattr(torch, leaf["dtype"])
        count = 1
        for size in leaf["shape"]:
            count *= size
        start, row = leaf["offset"], leaf.get("row")
        view = data[start: start + count * dtype.itemsize].view(dtype).view(leaf["shape"])
        per_row = count // leaf["shape"][0] if row is None and leaf["shape"][0] else count
        views.append((view, row, per_row * dtype.itemsize))
    return views


def _sizes(leaves: list, index: torch.Tensor) -> list[int]:
    """Bytes of each leaf in a message of rows ``index``."""
    rows = int(index.numel())
    if all(row is None for _leaf, row, _bytes in leaves):  # no lazy stack along dim 0: every leaf's rows
        return [rows * nbytes for _leaf, _row, nbytes in leaves]
    wanted = set(index.tolist())  # members of a stack along dim 0
    return [rows * nbytes if row is None else (nbytes if row in wanted else 0) for _leaf, row, nbytes in leaves]


def pack_rows(leaves: list, index: torch.Tensor, reserve: int = 0) -> torch.Tensor:
    """One message for a push: ``reserve`` bytes left free in front (a header; a multiple
    of 8), ``index`` (int64), then leaf after leaf its rows ``index`` (each copied once,
    straight into the message; ``leaves`` from :func:`leaf_views`)."""
    rows = int(index.numel())
    sizes = _sizes(leaves, index)
    message = torch.empty(reserve + 8 * rows + sum(sizes), dtype=torch.uint8)
    payload = message[reserve:]
    payload[: 8 * rows].view(torch.int64).copy_(index)
    offset = 8 * rows
    for (leaf, row, _bytes), size in zip(leaves, sizes):
        out = payload[offset: offset + size]
        if not size:
            pass  # a member of a stack along dim 0 that is not pushed
        elif row is not None or offset % leaf.element_size():  # a whole member, or not aligned
            out.copy_((leaf if row is not None else leaf.index_select(0, index)).reshape(-1).view(torch.uint8))
        else:
            torch.index_select(leaf, 0, index, out=out.view(leaf.dtype).view((rows, *leaf.shape[1:])))
        offset += size
    return message


def unpack_rows(leaves: list, message: torch.Tensor, rows: int) -> None:
    """Write the ``rows`` rows of a :func:`pack_rows` message into ``leaves``."""
    index = message[: 8 * rows].view(torch.int64)
    offset = 8 * rows
    for (target, row, _bytes), size in zip(leaves, _sizes(leaves, index)):
        chunk, start = message[offset: offset + size], offset
        offset += size
        if not size:
            continue
        if start % target.element_size():
            chunk = chunk.clone()  # rows of a smaller dtype came before: realign
        if row is not None:
            target.view(-1).copy_(chunk.view(target.dtype))
        else:
            target.index_copy_(0, index, chunk.view(target.dtype).view((rows, *target.shape[1:])))


def _words(segment: Segment) -> torch.Tensor:
    start = (segment.nbytes - _TRAILER) // 8
    return torch.empty(0, dtype=torch.int64).set_(segment.storage, start, (2,))


def state(segment: Segment) -> int:
    """The state word of a replica segment: 2 * version, odd while being written."""
    return int(_words(segment)[1])


def set_state(segment: Segment, state: int) -> None:
    _words(segment)[1] = state


def _replica_segment(td) -> Segment:
    for leaf in tensor_leaves(td):
        backing = getattr(leaf, "_backing", None)
        if isinstance(backing, Segment) and backing.nbytes > _TRAILER and int(_words(backing)[0]) == _MAGIC:
            return backing
    raise ValueError("This tensordict is not a replica of a name published on another node "
                     "(on the owner's node the data is written in place: there is no version to "
                     "wait for; coord.version(name) gives the version it last delivered).")


def version(td) -> int | None:
    """The version of the contents of the replica ``td`` (exported as
    ``shared_td.version``): the owner's number of the delivery that wrote them (each
    sync and each pull takes the next one), read from the replica's own
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


def record_replica(cluster, store, name: str, generation: int, digest: str) -> None:
    """Record that this process holds a replica of ``name`` at ``generation`` of
    ``digest`` (``has/<name>/<node>``, signed): with the token of its claim of the node
    number, so that the record stops counting once another process runs as the node (see
    :func:`~shared_td.coordinator.cluster_sync.has_replica`)."""
    store.set_json(f"has/{name}/{cluster.node}", {"generation": generation, "digest": digest,
                                                   "claim": cluster._claim})


def forget_replica(cluster, store, name: str) -> None:
    """Take this node's record of ``name`` back (it holds no replica: its first attach failed)."""
    store.delete(f"has/{name}/{cluster.node}")
