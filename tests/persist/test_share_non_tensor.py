"""memmap_(share_non_tensor=True) with real processes (the seed page
TensorDictBase.memmap_): an in-place write of a non-tensor entry in one process is seen
by the others, whatever the value's type, file-backed or anonymous, under fork, spawn
and multiprocess (dill); concurrent writers never show a torn value; without sharing a
child's write reaches the files but not the parent (tensordict's semantics).

The child targets are in share_children.py (spawn children import them by name).
"""
from __future__ import annotations

import json
import multiprocessing
import pickle

import multiprocess
import pytest
import torch

from tests.persist import share_children as kids
from tests.persist.persist_helpers import dir_state, values_state

from shared_td import NonTensorData, NonTensorStack, TensorDict
from shared_td.containers.linked_list import LinkedList

JOIN_TIMEOUT = 60


def start(ctx, target, *args):
    process = ctx.Process(target=target, args=args)
    process.start()
    return process


def join(process) -> None:
    process.join(JOIN_TIMEOUT)
    if process.is_alive():
        process.kill()
        process.join(5)
        pytest.fail(f"child {process.name} did not finish within {JOIN_TIMEOUT} s")
    assert process.exitcode == 0, f"child {process.name} exited with {process.exitcode}"


def run(ctx, target, *args) -> None:
    join(start(ctx, target, *args))


def run_reader(ctx, tds):
    queue = ctx.Queue()
    process = start(ctx, kids.read_all, tds, queue)
    result = queue.get(timeout=JOIN_TIMEOUT)  # before join: a full pipe blocks the child
    join(process)
    return result


def expected(after: bool) -> dict:
    out = {key: pair[after] for key, pair in kids.VALUES.items()}
    out["sub.task"] = "inner, rewritten" if after else "inner"
    out["st"] = kids.STACK_AFTER if after else kids.STACK_BEFORE
    out["obs"] = [1.0 if after else 0.0, 0.0, 0.0]
    return out


def assert_values(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key in want:
        # the type too: a bool stays a bool (not 0/1), an int is not a tensor; a stack's
        # values are read as a LinkedList (a list), as tensordict's
        kind = LinkedList if key == "st" else type(want[key])
        assert type(got[key]) is kind and got[key] == want[key], (key, got[key], want[key])


# ------------------------------------------------------------ one writer, two readers
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_writes_are_seen_by_the_parent_and_a_second_child(method, tmp_path):
    ctx = multiprocessing.get_context(method)
    shared_file = kids.make_td().memmap_(tmp_path / "shared", share_non_tensor=True)
    shared_anon = kids.make_td().memmap_(share_non_tensor=True)
    private = kids.make_td().memmap_(tmp_path / "private")
    assert shared_anon.saved_path is None and shared_file.is_locked and shared_anon.is_locked

    run(ctx, kids.write_all, [shared_file, shared_anon, private])

    for td in (shared_file, shared_anon):
        assert_values(kids.snapshot(td), expected(after=True))
        assert td.is_memmap() and td.is_locked
    second = run_reader(ctx, [shared_file, shared_anon])
    for got in second:
        assert_values(got, expected(after=True))
    # file-backed: every meta.json holds the latest write (bytes and Point as pickles)
    assert_values(kids.snapshot(TensorDict.load_memmap(tmp_path / "shared", allow_pickle=True)),
                  expected(after=True))
    with open(tmp_path / "shared" / "s" / "meta.json", encoding="utf-8") as handle:
        assert json.load(handle)["data"] == kids.VALUES["s"][1]

    # without share_non_tensor: the parent keeps its values (only the tensor, a shared
    # file, changes), but the child's writes are on disk
    private_now = expected(after=False)
    private_now["obs"] = [1.0, 0.0, 0.0]
    assert_values(kids.snapshot(private), private_now)
    assert_values(kids.snapshot(TensorDict.load_memmap(tmp_path / "private", allow_pickle=True)),
                  expected(after=True))


def test_multiprocess_dill_child_writes_are_shared(tmp_path):
    ctx = multiprocess.get_context("spawn")  # arguments pickled by dill
    shared_file = kids.make_td().memmap_(tmp_path / "shared", share_non_tensor=True)
    shared_anon = kids.make_td().memmap_(share_non_tensor=True)
    run(ctx, kids.write_all, [shared_file, shared_anon])
    for td in (shared_file, shared_anon):
        assert_values(kids.snapshot(td), expected(after=True))
    # and a (forked) second child of the parent sees them too
    for got in run_reader(multiprocessing.get_context("fork"), [shared_file, shared_anon]):
        assert_values(got, expected(after=True))


def test_parent_writes_are_seen_by_a_child_and_back(tmp_path):
    ctx = multiprocessing.get_context("fork")
    td = kids.make_td().memmap_(tmp_path, share_non_tensor=True)
    td.set_("obj", kids.Point(5, 6))  # after memmap_, before the child exists
    td.set_("d", {"goal": (1, 2)})
    (got,) = run_reader(ctx, [td])
    assert got["obj"] == kids.Point(5, 6) and got["d"] == {"goal": (1, 2)}
    run(ctx, kids.write_one, td, "obj", {"tuple", 1})  # a set: pickled on disk, not JSON
    assert td["obj"] == {"tuple", 1}
    assert TensorDict.load_memmap(tmp_path, allow_pickle=True)["obj"] == {"tuple", 1}


def test_a_non_tensor_stack_shared_on_its_own(tmp_path):
    stack = NonTensorStack("a", "b", "c").memmap_(tmp_path, share_non_tensor=True)
    anonymous = NonTensorStack("a", "b", "c").memmap_(share_non_tensor=True)
    single = NonTensorData("walk", batch_size=[3]).memmap_(share_non_tensor=True)
    assert stack.is_memmap() and stack.is_locked and single._shared_value is not None
    run(multiprocessing.get_context("fork"), kids.write_stacks_directly,
        [(stack, 1, {"nested": "ü" * 70}), (anonymous, slice(0, 2), "z")])
    assert stack.tolist() == ["a", {"nested": "ü" * 70}, "c"]
    assert anonymous.tolist() == ["z", "z", "c"]
    assert TensorDict.load_memmap(tmp_path).tolist() == stack.tolist()
    # a spawned child gets them by pickle, the NonTensorData too
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = start(ctx, kids.read_entries, [TensorDict(st=stack, an=anonymous, single=single, batch_size=[3])], queue)
    (got,) = queue.get(timeout=JOIN_TIMEOUT)
    join(process)
    assert got == {"st": stack.tolist(), "an": ["z", "z", "c"], "single": "walk"}


def test_a_shared_entry_is_pickled_by_reference(tmp_path):
    values = [str(i) * 1000 for i in range(100)]  # 100 kB of distinct strings
    td = TensorDict(st=NonTensorStack(*values), batch_size=[100])
    td["big"] = NonTensorData("x" * 100_000, batch_size=[100])
    td.memmap_(tmp_path, share_non_tensor=True)
    blob = pickle.dumps(td)
    assert len(blob) < 5000
    assert pickle.loads(blob)["st"] == values  # (in this process: the same cells)


# ------------------------------------------------------------------------- concurrency
def test_concurrent_writers_never_show_a_torn_value(tmp_path):
    ctx = multiprocessing.get_context("fork")
    td = TensorDict(task=NonTensorData("start", batch_size=[2]), obs=torch.zeros(2), batch_size=[2])
    td.memmap_(tmp_path, share_non_tensor=True)
    go, stop, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    reader = start(ctx, kids.concurrent_reader, td, stop, queue)
    writers = [start(ctx, kids.concurrent_writer, td, w, 200, go) for w in (0, 1)]
    go.set()
    for writer in writers:
        join(writer)
    stop.set()
    reads, error = queue.get(timeout=JOIN_TIMEOUT)
    join(reader)
    assert error is None and reads > 0
    # the last write of all is the last write of one of the writers
    final = td["task"]
    assert kids.parse_value(final)[1] == 199
    # the meta.json holds the value of the last write too
    assert TensorDict.load_memmap(tmp_path)["task"] == final


def test_concurrent_element_writes_into_a_shared_stack_are_not_lost(tmp_path):
    ctx = multiprocessing.get_context("fork")
    td = TensorDict(st=NonTensorStack("x", "y", "z"), batch_size=[3])
    td.memmap_(tmp_path, share_non_tensor=True)
    go = ctx.Event()
    writers = [start(ctx, kids.element_writer, td, element, 150, go) for element in (0, 2)]
    go.set()
    for writer in writers:
        join(writer)
    assert td["st"] == ["0:149", "y", "2:149"]
    assert TensorDict.load_memmap(tmp_path)["st"] == ["0:149", "y", "2:149"]


# ---------------------------------------------------------- writes that must be refused
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "memmap"])
def test_per_element_write_into_a_shared_non_tensor_data_is_refused(tmp_path, shared):
    td = kids.make_td().memmap_(tmp_path, share_non_tensor=shared)
    before, files = values_state(td), dir_state(tmp_path)
    # "obs" comes first: nothing may be written before the non-tensor entry is checked
    for value in ({"obs": torch.tensor(5.0), "s": "x"},
                  {"obs": torch.tensor(5.0), "sub": {"task": "x"}},
                  {"obs": torch.tensor(5.0), "st": "X", "i": 3}):
        with pytest.raises(RuntimeError, match="per-element values"):
            td[0] = value
        assert values_state(td) == before
        assert dir_state(tmp_path) == files
        assert type(td.get("s")) is NonTensorData and td.is_locked
    # the value it holds may be written (as in tensordict): the tensor is written, the
    # entry stays one NonTensorData
    td[0] = {"obs": torch.tensor(5.0), "s": "walk", "sub": {"task": "inner"}}
    assert td["obs"][0] == 5 and type(td.get("s")) is NonTensorData and td["s"] == "walk"
    # a whole-value write still works
    td.set_("s", "whole")
    assert td["s"] == "whole"


def test_locked_shared_td_refuses_replacing_the_entry(tmp_path):
    td = kids.make_td().memmap_(tmp_path, share_non_tensor=True)
    cell = td.get("s")._shared_value
    with pytest.raises(RuntimeError, match="locked"):
        td["s"] = "replaced"
    assert td["s"] == "walk" and td.get("s")._shared_value is cell
    td.set_("s", "in place")  # the same entry object, the same cell
    assert cell.get() == "in place"


def test_unlocked_plain_td_still_turns_data_into_a_stack():
    # tensordict's semantics, unchanged by the refusal above
    td = TensorDict(task="walk", batch_size=[3])
    td[1] = {"task": "run"}
    assert td["task"] == ["walk", "run", "walk"]


# ------------------------------------------------------------ a tree's values: one memfd
def _value_memfds() -> set:
    """(st_dev, st_ino) of the memfds of shared values this process holds a descriptor
    of: compared as sets, as an earlier test's garbage may close one of its own meanwhile
    (a count of descriptors went flaky so)."""
    import os

    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:shared_td-value-"):
                st = os.stat(f"/proc/self/fd/{name}")
                found.add((st.st_dev, st.st_ino))
        except OSError:  # (the listing's own descriptor, or one closed by now)
            pass
    return found


def _set_value(td, key, value) -> None:
    td.set_(key, value)


@pytest.mark.parametrize("how", ["memmap_", "share_memory_", "lazy share_memory_"])
def test_the_values_of_a_tree_share_one_memfd(how):
    """The values shared by one call are cells of one memfd: 200 values, one descriptor
    (one each before: 200, and the memory of 200 pages); each value stays its own."""
    def tree():
        return TensorDict({f"task{i}": f"walk to door {i}" for i in range(100)}, batch_size=[])

    source = TensorDict(a=tree(), b=tree(), batch_size=[]) if how != "lazy share_memory_" else \
        TensorDict.lazy_stack([tree(), tree()])
    before = _value_memfds()
    td = source.memmap_(share_non_tensor=True) if how == "memmap_" else source.share_memory_()
    assert len(_value_memfds() - before) == 1
    key = ("a", "task7") if how != "lazy share_memory_" else "task7"
    written = td if how != "lazy share_memory_" else td.tensordicts[0]
    run(multiprocessing.get_context("fork"), _set_value, written, key, "run")
    if how == "lazy share_memory_":
        assert td.tensordicts[0]["task7"] == "run" and td.tensordicts[1]["task7"] == "walk to door 7"
    else:
        assert td[key] == "run" and td["b", "task7"] == "walk to door 7" and td["a", "task6"] == "walk to door 6"
