"""Child-process targets for tests/test_memmap_tensor_multiprocess.py.

They live in their own module, importable by name, so that spawn and forkserver children
(which import the target instead of inheriting it) can find them. Each child *writes*
into the tensors it receives; the parent then checks that it sees the writes.
"""

import pickle

import torch

from shared_td.memmap_tensor import MemoryMappedTensor


def fill_pieces(pieces, values):
    """Fill each received piece with its value, after checking it arrived as an MMT."""
    for piece, value in zip(pieces, values):
        assert isinstance(piece, MemoryMappedTensor), type(piece)
        piece.fill_(value)


def fill_from_queue(queue, done):
    """Take ``(pieces, values)`` from ``queue``, fill them, report on ``done``."""
    try:
        pieces, values = queue.get(timeout=60)
        fill_pieces(pieces, values)
    except BaseException as err:  # report instead of dying silently
        done.put(f"error: {err!r}")
        raise
    done.put("ok")


def fill_pickled(blob, value):
    """Unpickle with plain ``pickle`` (no ForkingPickler involved) and fill."""
    fill_pieces([pickle.loads(blob)], [value])


def send_anonymous_pickle(conn):
    """Create an anonymous MMT, send its pickle, and exit (releasing the segment)."""
    tensor = MemoryMappedTensor.full(4, fill_value=3.0)
    conn.send_bytes(pickle.dumps(tensor))
    conn.close()


class WritingDataset(torch.utils.data.Dataset):
    """A dataset over MMTs whose ``__getitem__`` writes row ``i`` and returns views of it."""

    def __init__(self, *tensors):
        self.tensors = tensors

    def __len__(self):
        return self.tensors[0].shape[0]

    def __getitem__(self, index):
        for tensor in self.tensors:
            tensor[index] = index + 1
        return tuple(tensor[index] for tensor in self.tensors)
