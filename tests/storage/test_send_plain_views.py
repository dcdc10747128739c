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

import gc
import multiprocessing
import os
import resource
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from tests.processes import WAIT, finish

import shared_td
from shared_td.errors import FileReplacedError, MappingError
from shared_td.storage import anonymous, mapping, sending

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


# -- audit of 09d2a09: private mappings, one mapping per receiver, exit, replaced files ------

def private_views(tmp_path) -> dict:
    """Plain views over copy-on-write (private) mappings: their storage has no filename."""
    path = str(tmp_path / "a.memmap")
    shared_td.MemoryMappedTensor.from_tensor(torch.arange(4.0), filename=path)
    shared_td.TensorDict({"x": torch.arange(4.0)}, batch_size=[4]).memmap_(str(tmp_path / "saved"))
    shared_td.TensorDict({"x": torch.arange(4.0)}, batch_size=[4]).memmap(str(tmp_path / "arch.tdz"))
    return {
        "from_filename(mode=r)": lambda: shared_td.MemoryMappedTensor.from_filename(
            path, dtype=torch.float32, shape=(4,), mode="r").detach(),
        "load_memmap(mode=r)": lambda: shared_td.TensorDict.load_memmap(
            str(tmp_path / "saved"), mode="r")["x"].as_subclass(torch.Tensor),
        "archive": lambda: shared_td.TensorDict.load_memmap(str(tmp_path / "arch.tdz"))["x"].as_subclass(torch.Tensor),
    }


@pytest.mark.parametrize("case", ["from_filename(mode=r)", "load_memmap(mode=r)", "archive"])
def test_a_plain_view_of_a_private_mapping_goes_by_reference(case, tmp_path):
    """Ours by our own attribute, not by ``filename`` (None for a private mapping):
    torch's reducer sent DupFd(-1) for it (EBADF; the receiver waited for ever)."""
    view = private_views(tmp_path)[case]()
    assert view.untyped_storage().filename is None
    blob = ForkingPickler.dumps(view)
    assert str(tmp_path) in bytes(blob).decode("latin-1")  # the path, never the bytes
    assert ForkingPickler.loads(blob).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_storage_not_ours_is_told_without_a_search(monkeypatch, tmp_path):
    """A user's torch.from_file storage (it has a filename) is not ours: no scan of this
    process's segments and files (that cost O(segments + files) per storage pickled)."""
    path = tmp_path / "user.bin"
    path.write_bytes(bytes(16))
    users = torch.from_file(str(path), shared=True, size=4, dtype=torch.float32)
    keep = [shared_td.MemoryMappedTensor.zeros(4), shared_td.MemoryMappedTensor.zeros(4, filename=tmp_path / "f")]

    def no_scan():
        raise AssertionError("searched every mapping of this process")
    monkeypatch.setattr(anonymous._CACHE, "values", no_scan)
    monkeypatch.setattr(mapping._CACHE, "values", no_scan)
    assert sending.mapped_memory(users.untyped_storage()) is None
    assert all(sending.mapped_memory(t.detach().untyped_storage()) is not None for t in keep)


def _descriptors_of(key: tuple[int, int]) -> int:
    """How many of this process's descriptors name the file ``key`` (st_dev, st_ino):
    only those, as a garbage cycle inherited from the test process that forked us may
    close a descriptor of its own meanwhile (that made the count of all of them flaky)."""
    found = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        found += (st.st_dev, st.st_ino) == tuple(key)
    return found


def receive_rows(queue, events, count: int) -> None:
    """Take the (st_dev, st_ino) of a file or segment off ``queue``, then keep ``count``
    tensors; say how many descriptors of that file or segment this process opened and
    how many distinct mappings the tensors view."""
    try:
        key = queue.get(timeout=WAIT)
        before = _descriptors_of(key)
        kept = [queue.get(timeout=WAIT) for _ in range(count)]
        events.put((_descriptors_of(key) - before, len({t.untyped_storage().data_ptr() for t in kept})))
    except Exception as error:  # (the test shows it)
        events.put(("error", repr(error)))


@pytest.mark.parametrize("where", ["segment", "file"])
def test_a_receiver_keeps_one_mapping_of_what_it_receives_many_views_of(where, tmp_path):
    """Many rows of one buffer sent as plain views: the receiver maps the segment (one
    descriptor) or the file once, as for MemoryMappedTensor rows (before: one mapping,
    and for a segment one descriptor, per row received; EMFILE after ~1000 rows)."""
    count = 40
    context = multiprocessing.get_context("fork")
    queue, events = context.Queue(), context.Queue()
    process = context.Process(target=receive_rows, args=(queue, events, count))
    process.start()  # before the buffer: the receiver does not inherit its mapping
    buffer = shared_td.MemoryMappedTensor.zeros((count, 1024), filename=(
        tmp_path / "rows.memmap" if where == "file" else None))
    st = os.fstat(buffer._backing.fd) if where == "segment" else os.stat(buffer._backing.path)
    queue.put((st.st_dev, st.st_ino))  # what the receiver counts descriptors of
    for row in range(count):
        queue.put(buffer.detach()[row])
    opened, mappings = events.get(timeout=WAIT)
    assert finish(process) == 0
    assert (opened, mappings) == ((1 if where == "segment" else 0), 1)


EXIT_PUT = """
import multiprocessing, sys
import torch
from shared_td import MemoryMappedTensor
from shared_td.storage.shared_value import SharedValue

def receive(queue, started):
    started.set()
    try:
        views, cell = queue.get(timeout=20)
        print("received", [float(v.sum()) for v in views], cell.get(), flush=True)
    except Exception as error:
        print("failed", repr(error), flush=True)

if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    queue, started = context.Queue(), context.Event()
    context.Process(target=receive, args=(queue, started)).start()
    started.wait(60)  # (a spawn child still starting would find the queue's semaphores gone)
    views = [MemoryMappedTensor.full((4,), fill_value=1.0).detach() for _ in range(3)]
    queue.put((views, SharedValue.create("walk")))
    # main returns at once: the queue's feeder thread pickles after the atexit hooks
"""


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_view_put_on_a_queue_as_main_returns_arrives(method, tmp_path):
    """The descriptors are not closed at interpreter exit (the kernel closes them):
    the feeder thread, which pickles after atexit hooks, duplicated a closed descriptor
    (EBADF) and the receiver got nothing (with a plain get(), the program hung)."""
    script = tmp_path / "exit_put.py"
    script.write_text(EXIT_PUT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True,
                            timeout=90, env=env)
    assert "received [4.0, 4.0, 4.0] walk" in result.stdout, result.stdout + result.stderr[-2000:]


def test_a_plain_view_of_a_replaced_file_is_refused(tmp_path):
    """Every tensor of the file gone but a plain view, and a new file renamed over its
    path: sending it by that path would give the receiver other bytes (silently)."""
    tree = make_tree(shared_td, "file", tmp_path / "saved")
    view, path = tree["a"].detach(), tree["a"].filename
    del tree
    gc.collect()
    shared_td.MemoryMappedTensor.from_tensor(torch.full((4, 2), 7.0), filename=path + ".new")
    os.rename(path + ".new", path)
    with pytest.raises(FileReplacedError, match="no longer at"):
        ForkingPickler.dumps(view)


def test_a_plain_view_unpickled_by_multiprocess_in_its_own_process():
    """multiprocess's pickler sends a segment by /proc: in its own process, with only a
    plain view left, the descriptor is still open (before: 'released in this process')."""
    mp_reduction = pytest.importorskip("multiprocess.reduction")
    view = shared_td.MemoryMappedTensor.full((4,), fill_value=2.0).detach()
    gc.collect()
    received = mp_reduction.ForkingPickler.loads(mp_reduction.ForkingPickler.dumps(view))
    received[0] = 9.0
    assert view.tolist() == [9.0, 2.0, 2.0, 2.0]
