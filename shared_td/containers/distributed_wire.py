"""What tensordict's ``torch.distributed`` methods put on the wire (distributed_ops.py).

Leaf by leaf (``send``/``recv``/``isend``/``irecv``, ``reduce``, ``all_reduce``): the
tensors of the tree in tensordict 0.15.3's order, each level's keys sorted and a lazy
stack member after member, with its tags (``init_tag``, ``init_tag + 1``, ... or
tensordict's pseudo-random chain), so that a tensordict rank and a shared_td rank
exchange the leaves of the same structure. Non-tensor values have no leaf: they are not
sent, as in tensordict. A leaf that cannot go in place (not contiguous) goes through a
contiguous copy, written back into the leaf once its transfer is done.

Whole trees (``init_remote``/``from_remote_init``, ``broadcast``, ``scatter``,
``all_gather``, ``gather_and_stack``), for a receiver that does not know the structure: the consolidated
tree pickled with protocol 5, its buffer out of band. A message is a header (the pickle's
length and the buffers' lengths, int64), the pickle, then each buffer as it is (the
consolidated buffer is sent without a copy, and received into the storage the result's
leaves are views of). A sender that cannot build its message (a value pickle refuses) sends a failure notice
instead (a negative first count, then its error's text), so the receivers raise at once
rather than wait for the group's timeout. Unpickling runs what the sender's pickle names, as
``torch.distributed.recv_object_list`` and tensordict's own: use it only between ranks
you trust, on a private network.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable, Iterator

import numpy as np
import torch

from shared_td.containers.value_kinds import is_lazy_stack, is_non_tensor, is_tensor_collection
from shared_td.memmap_tensor import refuse_read_only
from shared_td.tensorclass_protocol import unwrap_tensorclass

_BYTE = torch.uint8
_INT = torch.int64


# ------------------------------------------------------------------ leaf by leaf
def wire_leaves(obj: Any) -> list[tuple[tuple, torch.Tensor]]:
    """``(key path, tensor)`` for every tensor leaf of ``obj``, in tensordict's order."""
    leaves: list = []
    _collect(obj, (), leaves)
    return leaves


def _collect(obj: Any, path: tuple, leaves: list) -> None:
    # (a list filled by plain recursion: nested generators cost a third of a batch's send)
    node = unwrap_tensorclass(obj)
    if is_non_tensor(node):
        return
    if is_lazy_stack(node):
        for member in node.tensordicts:
            _collect(member, path, leaves)
        return
    for key in sorted(node._keys_str()):
        value = node._get_str(key, None)
        if isinstance(value, torch.Tensor):
            leaves.append((path + (key,), value))
        elif is_tensor_collection(value):
            _collect(value, path + (key,), leaves)


def wire_tags(init_tag: int, pseudo_rand: bool) -> Iterator[int]:
    """The tag of each leaf in turn: ``init_tag``, ``init_tag + 1``, ... or, with
    ``pseudo_rand``, tensordict's chain (each tag drawn from a generator seeded by the
    previous one plus one, below 10000), so that the ranks of both packages agree."""
    tag = init_tag - 1
    while True:
        tag = _next_pseudo_random(tag + 1) if pseudo_rand else tag + 1
        yield tag


def _next_pseudo_random(seed: int) -> int:
    return int.from_bytes(np.random.default_rng(seed).bytes(8), "big") % 10_000


def check_peer(peer: Any, group_peer: int | None, group: Any, name: str, group_name: str) -> None:
    """As torch's point-to-point functions: a peer by global rank or by its rank in
    ``group``, exactly one of them."""
    if group_peer is not None:
        if group is None:
            raise ValueError(f"`{group_name}` requires `group` to be passed.")
        if peer is not None:
            raise ValueError(f"`{name}` and `{group_name}` are mutually exclusive.")
    elif peer is None:
        raise ValueError(f"Exactly one of `{name}` and `{group_name}` must be provided.")
    elif not isinstance(peer, int) or isinstance(peer, bool):
        raise TypeError(f"`{name}` must be a rank (an int), got {type(peer).__name__}: shared_td sends "
                        f"through torch.distributed only (tensordict's UCXX pipes are not built).")


def check_writable(path: tuple, tensor: torch.Tensor) -> None:
    """Raise before anything is received if a transfer cannot write the leaf at
    ``path``: mapped read-only (ReadOnlyError), or expanded (a ValueError: a stride 0
    over several elements holds one value for many of its positions)."""
    if type(tensor) is not torch.Tensor:  # (a plain tensor is never mapped read-only: no message to make)
        refuse_read_only(tensor, f"a receive into {shown(path)}")
    strides = tensor.stride()
    if 0 in strides and any(stride == 0 and size > 1 for stride, size in zip(strides, tensor.shape)):
        raise ValueError(f"Cannot receive into {shown(path)}: it is expanded (several of its "
                         f"elements are one value in memory); clone it first. Nothing was received.")


def shown(path: tuple) -> str:
    return repr(path[0] if len(path) == 1 else path)


class HeldTransfer:
    """A posted transfer that holds the tensor it moves (a copy, or a buffer
    consolidated for it, which nothing else holds) until it is done; for leaves that
    went through a contiguous copy (a receive, a collective), ``wait()`` then writes the
    copy into them. It stands where torch's ``Work`` would, for code that waits on each
    of a list."""

    __slots__ = ("work", "copy", "leaves")

    def __init__(self, work: Any, copy: torch.Tensor, leaves: list[torch.Tensor]):
        self.work, self.copy, self.leaves = work, copy, leaves

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        start, flat = 0, self.copy.view(-1)  # (contiguous: a copy, or the leaves packed)
        with torch.no_grad():
            for leaf in self.leaves:
                count = leaf.numel()
                leaf.copy_(flat[start:start + count].view(leaf.shape))
                start += count
        return done

    def is_completed(self) -> bool:
        return self.work.is_completed()


def in_place(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor torch.distributed gets for a leaf: itself as a plain tensor (a
    MemoryMappedTensor, a subclass, writes its file through it)."""
    return tensor if type(tensor) is torch.Tensor else tensor.as_subclass(torch.Tensor)


# ------------------------------------------------------------------ whole trees
def tree_message(obj: Any) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(header, pickle, buffers)`` of ``obj``, consolidated first if it is not."""
    if not obj.is_consolidated():
        obj = obj.consolidate()
    buffers: list = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    tensors = [_bytes_tensor(buffer.raw()) for buffer in buffers]
    header = torch.tensor([len(data), len(tensors), *(t.numel() for t in tensors)], dtype=_INT)
    return header, _bytes_tensor(bytearray(data)), tensors


def _bytes_tensor(data: Any) -> torch.Tensor:
    view = memoryview(data)
    if not view.nbytes:
        return torch.empty(0, dtype=_BYTE)
    if view.readonly:  # (a read-only array's buffer: torch takes writable memory only)
        view = memoryview(bytearray(view))
    return torch.from_numpy(np.frombuffer(view, dtype=np.uint8))


def tree_of(data: torch.Tensor, buffers: list[torch.Tensor]) -> Any:
    """The tree a message carried: its pickle loaded over the received buffers (the
    consolidated one becomes the tree's storage, no copy)."""
    return pickle.loads(data.numpy().tobytes(), buffers=[buffer.numpy() for buffer in buffers])


def header_fields(header: torch.Tensor) -> tuple[int, list[int]]:
    """The pickle's length and the buffers' lengths of a received header."""
    values = header.tolist()
    return values[0], values[2:2 + values[1]]


def flat_message(obj: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(header, bytes)`` of ``obj``: the pickle and its buffers one after the other
    (for the collectives that pad every rank's message to one size); ``obj`` None: an
    empty message."""
    if obj is None:
        return torch.zeros(2, dtype=_INT), torch.empty(0, dtype=_BYTE)
    header, data, buffers = tree_message(obj)
    return header, torch.cat([data, *buffers])


def tree_of_flat(header: torch.Tensor, flat: torch.Tensor) -> Any:
    """The tree of a ``flat_message`` (``flat`` may be longer: padding)."""
    length, lengths = header_fields(header)
    parts = flat[:length + sum(lengths)].split([length, *lengths])
    return tree_of(parts[0], list(parts[1:]))


# ------------------------------------------- a whole tree, part by part, or a failure notice
def message_parts(obj: Any) -> tuple[torch.Tensor, ...]:
    """The parts of ``obj``'s message, in the order :func:`read_tree` reads them: the
    pickle's length and the buffers' count, the buffers' lengths, the pickle, each buffer."""
    header, data, buffers = tree_message(obj)
    return header[:2], header[2:], data, *buffers


def send_tree(obj: Any, send: Callable[[torch.Tensor], Any]) -> Any:
    """Send ``obj``'s message, part by part, through ``send``; returns ``obj``
    consolidated. If it cannot be built (a non-tensor value pickle refuses), a failure
    notice goes instead, then the error is raised: the receivers raise it too rather
    than wait for the group's timeout."""
    try:
        consolidated = obj if obj.is_consolidated() else obj.consolidate()
        parts = message_parts(consolidated)
    except Exception as error:
        send_notice(error, send)
        raise
    for tensor in parts:
        send(tensor)
    return consolidated


FAILED = -1  # a message's first count when its sender could not build it; the second: its error text's length


def failure_text(error: Exception) -> torch.Tensor:
    try:
        text = f"{type(error).__name__}: {error}"
    except Exception:  # (its __str__ raised: the receivers still get a notice, not the group's timeout)
        text = f"{type(error).__name__} (its message could not be made)"
    return torch.tensor(bytearray(text[:2000].encode(errors="replace")), dtype=_BYTE)


def send_notice(error: Exception, send: Callable[[torch.Tensor], Any]) -> None:
    text = failure_text(error)
    send(torch.tensor([FAILED, text.numel()]))
    send(text)


def sender_failed(notices: list[tuple[str, torch.Tensor]]) -> RuntimeError:
    """The error of a receiver given the ``(sender, its error's text)`` of failure notices."""
    return RuntimeError("; ".join(f"{sender} could not send its tensordict, and raised there: "
                                  f"{text.numpy().tobytes().decode(errors='replace').rstrip('.')}"
                                  for sender, text in notices) + ". Nothing was received.")


def first_counts(received: Callable[[torch.Tensor], torch.Tensor], sender: str) -> list[int]:
    """A message's first two counts; a failure notice raises its sender's error here."""
    counts = received(torch.empty(2, dtype=_INT)).tolist()
    if counts[0] == FAILED:
        raise sender_failed([(sender, received(torch.empty(counts[1], dtype=_BYTE)))])
    return counts


def read_tree(received: Callable[[torch.Tensor], torch.Tensor], sender: str) -> Any:
    """The tree of a message (see ``send_tree``), each of its parts filled by
    ``received(empty tensor)``."""
    counts = first_counts(received, sender)
    lengths = received(torch.empty(counts[1], dtype=_INT)).tolist()
    data = received(torch.empty(counts[0], dtype=_BYTE))
    return tree_of(data, [received(torch.empty(length, dtype=_BYTE)) for length in lengths])
