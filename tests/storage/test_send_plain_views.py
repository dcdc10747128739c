"""Plain torch tensors over shared_td's memory sent through multiprocessing.

``detach()``, ``view()``, ``.data`` and ``as_subclass(torch.Tensor)`` of a memory-mapped
leaf, and the leaves of ``td.detach()``, ``td.view()``, ``td.reshape()`` and
``td.apply(...)``, are plain ``torch.Tensor`` views of a segment or a mapped file. torch's
own storage reducer sent them as ``DupFd(-1)`` (torch keeps no descriptor of a mapping
made by ``torch.from_file``): ``OSError: [Errno 9]`` in the queue's feeder thread, and
the receiver (a DataLoader's main process) waited for ever. They now go by reference,
as a view of the same memory (the receiver's writes reach the sender), through the
ForkingPickler of multiprocessing (queues, process arguments, DataLoader workers) and
of ``multiprocess`` (the coordinator's); tensordict 0.15.3 sends its anonymous ones too.
Also here: a receiver out of descriptors gets a MappingError naming RLIMIT_NOFILE.
"""
from __future__ import annotations

import multiprocessing
import os
import resource
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from tests.processes import WAIT, finish

import shared_td
from shared_td.errors import MappingError
from shared_td.storage import anonymous, sending

pytestmark = pytest.mark.timeout(120)


def library(name: str):
    return pytest.importorskip("tensordict") if name == "tensordict" else shared_td


def make_tree(lib, source: str, where=None):
    """A tree whose "a" (4 x 2) and ("n", "b") (4) hold zeros, in ``source``'s memory."""
    td = lib.TensorDict({"a": torch.zeros(4, 2), "n": {"b": torch.zeros(4)}}, batch_size=[4])
    if source == "memmap":
        return td.memmap_()
    if source == "consolidated":
        return td.consolidate(share_memory=True)
    return td.memmap_(str(where))  # "file"


# what is sent, made of the tree; the received object's view of "a" (all of it)
SENT = {
    "leaf.detach()": lambda td: td["a"].detach(),
    "leaf.view(-1)": lambda td: td["a"].view(-1),
    "leaf.data": lambda td: td["a"].data,
    "leaf.as_subclass": lambda td: td["a"].as_subclass(torch.Tensor),
    "td.detach()": lambda td: td.detach(),
    "td.view(2, 2)": lambda td: td.view(2, 2),
    "td.reshape(-1)": lambda td: td.reshape(-1),
    "td.apply(view)": lambda td: td.apply(lambda x: x.view(x.shape)),
}


def leaf_a(received) -> torch.Tensor:
    return received if isinstance(received, torch.Tensor) else received["a"]


@pytest.mark.parametrize("op", list(SENT))
@pytest.mark.parametrize("name, source", [("shared_td", "memmap"), ("shared_td", "consolidated"),
                                          ("shared_td", "file"), ("tensordict", "memmap"),
                                          ("tensordict", "consolidated")])
def test_a_plain_view_pickles_as_a_view_of_the_same_memory(name, source, op, tmp_path):
    tree = make_tree(library(name), source, tmp_path / "saved")
    sent = SENT[op](tree)
    if type(leaf_a(sent)) is not torch.Tensor:
        assert name == "tensordict"  # (its reshape to the same shape keeps its leaves)
        pytest.skip("tensordict sends a MemoryMappedTensor here, not a plain view")
    received = ForkingPickler.loads(ForkingPickler.dumps(sent))
    leaf = leaf_a(received)
    assert leaf.data_ptr() == tree["a"].data_ptr()  # the same memory, not a copy
    leaf.fill_(3.0)
    assert tree["a"].tolist() == [[3.0, 3.0]] * 4


def test_a_file_backed_view_pickles_by_its_path(tmp_path):
    """(tensordict 0.15.3 cannot send these: EBADF, as shared_td could not.)"""
    tree = make_tree(shared_td, "file", tmp_path / "saved")
    blob = ForkingPickler.dumps(tree["a"].detach())
    assert str(tmp_path / "saved") in bytes(blob).decode("latin-1")  # the path, never the bytes
    del tree  # every tensor of the file gone: the plain view still names it
    view = ForkingPickler.loads(blob)
    assert view.shape == (4, 2) and view.tolist() == [[0.0, 0.0]] * 4


def test_other_storages_still_go_through_torch():
    from torch.multiprocessing.reductions import reduce_storage

    registered = ForkingPickler._extra_reducers[torch.UntypedStorage]
    assert registered.keywords["fallback"] is reduce_storage  # registered after torch's
    received = ForkingPickler.loads(ForkingPickler.dumps(torch.ones(3)))
    assert received.is_shared() and received.tolist() == [1.0] * 3  # torch's shared memory


def test_a_reducer_registered_before_is_kept_for_other_storages():
    seen = []

    def users(storage):  # a user's own reducer for storages, registered before ours
        seen.append(storage.nbytes())
        return torch.UntypedStorage, (storage.nbytes(),)

    class Pickler(ForkingPickler):  # torch's reducers, but the user's for storages
        _extra_reducers = {**ForkingPickler._extra_reducers, torch.UntypedStorage: users}

    sending._register_storage_reducers(Pickler, {torch.UntypedStorage: sending._reduce_storage})
    tree = make_tree(shared_td, "memmap")
    Pickler.loads(Pickler.dumps(torch.zeros(2)))
    assert seen == [8]  # theirs for a storage of torch's
    view = Pickler.loads(Pickler.dumps(tree["a"].detach()))
    assert seen == [8] and view.data_ptr() == tree["a"].data_ptr()  # ours for ours


# -- real processes ---------------------------------------------------------------------

def fill_received(queue, events) -> None:
    """Take one object off ``queue``, fill its "a" (or itself) with 7, say what it holds."""
    try:
        leaf = leaf_a(queue.get(timeout=WAIT))
        leaf.fill_(7.0)
        events.put(("filled", leaf.flatten().tolist()))
    except Exception as error:  # (the test shows it)
        events.put(("error", repr(error)))


@pytest.mark.parametrize("context_name, name, dropped", [
    ("fork", "shared_td", False), ("fork", "shared_td", True), ("spawn", "shared_td", True),
    ("fork", "tensordict", True), ("multiprocess-fork", "shared_td", True)])
def test_a_detached_tree_sent_to_another_process_is_shared(context_name, name, dropped):
    """``dropped``: only the detached (plain) tree is left in the sender when it is sent.
    ``multiprocess-fork``: multiprocess's own pickler (dill), which the coordinator uses."""
    if context_name.startswith("multiprocess"):
        context = pytest.importorskip("multiprocess").get_context("fork")
    else:
        context = multiprocessing.get_context(context_name)
    tree = make_tree(library(name), "memmap")
    sent = tree.detach()
    if dropped:
        del tree
    queue, events = context.Queue(), context.Queue()
    process = context.Process(target=fill_received, args=(queue, events))
    process.start()
    try:
        queue.put(sent)
        assert events.get(timeout=WAIT) == ("filled", [7.0] * 8)
    finally:
        assert finish(process) == 0
    assert sent["a"].tolist() == [[7.0, 7.0]] * 4  # the receiver's writes reached us


class DetachedSamples(torch.utils.data.Dataset):
    """Item ``i``: ``td.detach()[i]`` of a tree in anonymous shared memory: ``held`` by
    the dataset (made in the main process), or made by the worker for the item and
    dropped (only the detached view is left to send)."""

    def __init__(self, name: str, held: bool):
        self.name, self.held = name, held
        self.tree = make_tree(library(name), "memmap") if held else None

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int):
        if self.held:
            return self.tree.detach()[index]
        tree = make_tree(library(self.name), "memmap")
        tree["a"].fill_(float(index))
        return tree.detach()[index]


def first(samples: list):
    return samples[0]


@pytest.mark.parametrize("method, name, held", [
    ("fork", "shared_td", True), ("fork", "shared_td", False), ("spawn", "shared_td", True),
    ("fork", "tensordict", True), ("fork", "tensordict", False)])
def test_dataloader_workers_return_detached_trees(method, name, held):
    workers = 2 if method == "fork" else 1  # a spawn worker's start costs seconds
    dataset = DetachedSamples(name, held)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=workers, collate_fn=first,
                                         multiprocessing_context=method, timeout=WAIT)
    batches = list(loader)  # (timed out, hung for ever before: EBADF in the worker)
    assert len(batches) == 4 and all(type(batch["a"]) is torch.Tensor for batch in batches)
    if not held:
        assert [batch["a"].tolist() for batch in batches] == [[float(i)] * 2 for i in range(4)]
        return
    for index, batch in enumerate(batches):
        batch["a"].fill_(float(index + 1))  # writes into the dataset's own memory
    if name == "shared_td":  # (tensordict 0.15.3's worker sent a copy of its memory)
        assert dataset.tree["a"].tolist() == [[float(i + 1)] * 2 for i in range(4)]


# -- a receiver out of descriptors ------------------------------------------------------

def send_trees(queue, done) -> None:
    """Put three anonymous trees (three segments) on ``queue`` and hold them until ``done``."""
    trees = [make_tree(shared_td, "memmap") for _ in range(3)]
    queue.put(trees)
    done.get(timeout=WAIT)


def receive_with_descriptors_free(queue, events, free: int) -> None:
    """Lower RLIMIT_NOFILE, take all descriptors but ``free``, then receive."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        for _ in range(free):
            os.close(held.pop())
    try:
        queue.get(timeout=WAIT)
        events.put(("received", ""))
    except Exception as error:
        events.put((type(error).__name__, str(error)))


@pytest.mark.parametrize("free", [1, 2])
def test_a_receiver_out_of_descriptors_is_told_its_limit(free):
    """Taking a duplicate costs two descriptors (the connection, and a duplicate of it
    that receives); with two free, the one sent by SCM_RIGHTS is then dropped by the
    kernel (no room for it) and multiprocessing raised RuntimeError('received 0 items
    of ancdata'). The /proc route is tried, and the error names the segment and
    RLIMIT_NOFILE (one free: the duplicate of the connection fails, and so did it)."""
    context = multiprocessing.get_context("fork")
    queue, events, done = context.Queue(), context.Queue(), context.Queue()
    sender = context.Process(target=send_trees, args=(queue, done))
    receiver = context.Process(target=receive_with_descriptors_free, args=(queue, events, free))
    sender.start()
    receiver.start()
    try:
        kind, message = events.get(timeout=WAIT)
    finally:
        done.put(1)
        finish(receiver)
        finish(sender)
    assert kind == "MappingError", (kind, message)
    assert "RLIMIT_NOFILE" in message and "inode" in message and "ulimit -n" in message
    assert issubclass(MappingError, OSError)


def test_a_truncated_receive_goes_to_the_proc_route():
    """Without a process: a duplicate whose receive was truncated is taken through the
    ``/proc`` route (``fallback``) instead; when that finds the sender gone, the error
    is still this process's limit."""
    segment = anonymous.Segment.create(64)

    class Truncated:
        def detach(self):
            raise RuntimeError("received 0 items of ancdata")

    def gone():
        raise anonymous.SegmentUnavailableError("gone")

    def receive(fallback):
        return anonymous.receive_duplicate(Truncated(), segment.key, 64, os.getpid(), what="test memory",
                                           cached=lambda key: None, adopt=pytest.fail, fallback=fallback)

    assert receive(lambda: segment) is segment
    with pytest.raises(MappingError, match="RLIMIT_NOFILE") as caught:
        receive(gone)
    assert f"test memory (inode {segment.key[1]})" in str(caught.value)
