"""Sending trees between processes, findings of the session-18 audit, side by side with
tensordict 0.15.3 where it supports the case: a consolidated tree's values outside its
buffer go through the outer pickler (a child's writes reach the parent, an anonymous
leaf and a shared non-tensor value arrive after a live sender dropped them); its
skeleton loads no global of its own; a sub-tree locked by its parent arrives locked; a
counter whose sender died says so in a counter's words."""
from __future__ import annotations

import copyreg
import gc
import io
import multiprocessing
import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import shared_td
from shared_td.containers import consolidated_pickle
from shared_td.errors import SegmentUnavailableError
from tests.processes import WAIT, finish


def _library(name: str):
    return shared_td if name == "shared_td" else pytest.importorskip(name)


# --------------------------------------------------------------- child processes
def write_sevens(inbox, answers, keys) -> None:
    """Take one tree from ``inbox``, fill its leaves ``keys`` with 7 (the parent looks)."""
    td = inbox.get(timeout=WAIT)
    for key in keys:
        td[key].fill_(7)
    answers.put("written")


def _anonymous_leaf_tree():
    td = shared_td.TensorDict({"a": torch.zeros(4)}, batch_size=[4]).consolidate().unlock_()
    td["anon"] = shared_td.TensorDict({"x": torch.ones(4)}, batch_size=[4]).memmap_()["x"]
    return td


def _shared_nontensor_tree():
    return shared_td.TensorDict({"a": torch.ones(3), "s": shared_td.NonTensorData("hello")},
                                batch_size=[3]).share_memory_()


def send_then_drop(connection, dropped, done) -> None:
    """Send a consolidated tree with an anonymous leaf, then a shared tree with a
    non-tensor, through ``connection`` (ForkingPickler, in this thread), drop them, say
    so, and stay alive until the receiver is done."""
    trees = [_anonymous_leaf_tree(), _shared_nontensor_tree()]
    for td in trees:
        connection.send(td)
    del trees, td
    gc.collect()
    dropped.set()
    done.wait(WAIT)


def send_counter_bytes(connection) -> None:
    """Send a new counter's ForkingPickler bytes, then exit (the counter with this process)."""
    connection.send_bytes(bytes(ForkingPickler.dumps(shared_td.SharedCounter(3))))


# --------------------------------------- 1: values outside the buffer, the outer pickler
@pytest.mark.parametrize("lib, method", [("shared_td", "fork"), ("shared_td", "spawn"), ("tensordict", "fork")])
def test_a_leaf_outside_the_buffer_is_shared_as_in_a_plain_tree(lib, method):
    # before: the skeleton's own pickler sent "new" by value (the child wrote a copy)
    # while "a", in the buffer, was shared: half shared, nothing raised
    T = _library(lib)
    td = T.TensorDict({"a": torch.zeros(4), "n": {"b": torch.zeros(4)}}, batch_size=[4]).consolidate()
    td.unlock_()
    td["new"] = torch.zeros(4)
    ctx = multiprocessing.get_context(method)
    inbox, answers = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=write_sevens, args=(inbox, answers, ("a", "new")))
    child.start()
    try:
        inbox.put(td)
        assert answers.get(timeout=WAIT) == "written"
    finally:
        assert finish(child) == 0
    assert td["a"].tolist() == [7.0] * 4 and td["new"].tolist() == [7.0] * 4


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_received_after_a_live_sender_dropped_it(method):
    # before: an anonymous leaf of a consolidated tree went by /proc (the skeleton's
    # pickler), and a shared non-tensor value had only the /proc route: gone with the
    # sender's object, the whole tree was lost (SegmentUnavailableError), its sender alive
    ctx = multiprocessing.get_context(method)
    receiver, sender = ctx.Pipe(duplex=False)
    dropped, done = ctx.Event(), ctx.Event()
    child = ctx.Process(target=send_then_drop, args=(sender, dropped, done))
    child.start()
    try:
        assert dropped.wait(WAIT), "the sender never dropped its trees"
        assert receiver.poll(WAIT)
        consolidated = receiver.recv()
        assert consolidated["anon"].tolist() == [1.0] * 4 and consolidated["a"].tolist() == [0.0] * 4
        shared = receiver.recv()
        assert shared["s"] == "hello" and shared["a"].tolist() == [1.0] * 3
        shared.set_("s", "written")  # the received cell works
        assert shared["s"] == "written"
    finally:
        done.set()
        assert finish(child) == 0


class Tag:
    """A user value: pickled by whatever pickler pickles the tree."""

    def __init__(self, text: str):
        self.text = text


def test_values_outside_the_buffer_follow_the_outer_picklers_rules():
    td = shared_td.TensorDict(a=torch.zeros(2), tag=shared_td.NonTensorData(Tag("mine")), batch_size=[]).consolidate()
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    pickler.dispatch_table[Tag] = lambda tag: (Tag, ("by the outer pickler",))
    pickler.dump(td)
    again = pickle.loads(out.getvalue())
    # before: "mine" (the skeleton's pickler, not this one, pickled the value)
    assert again["tag"].text == "by the outer pickler"
    assert again.is_consolidated() and (again["a"] == 0).all()


# ------------------------------------------------------- 3: the skeleton names nothing
_RAN = []


def run_from_a_forged_skeleton() -> None:
    _RAN.append(True)


class _Called:
    def __reduce__(self):
        return run_from_a_forged_skeleton, ()


class _Forged:
    def __reduce__(self):
        return consolidated_pickle._unpickle_consolidated, (b"", [], pickle.dumps(_Called()))


class _OnlySharedTd(pickle.Unpickler):
    """An unpickler that loads the names of shared_td and torch only."""

    def find_class(self, module, name):
        if module.split(".")[0] not in ("shared_td", "torch", "collections"):
            raise pickle.UnpicklingError(f"refused {module}.{name}")
        return super().find_class(module, name)


def test_a_forged_skeleton_cannot_name_a_global():
    # before: the skeleton's unpickler resolved any global, so an unpickler that allows
    # shared_td's names only ran any function through _unpickle_consolidated
    with pytest.raises(pickle.UnpicklingError, match="refused"):
        _OnlySharedTd(io.BytesIO(pickle.dumps(_Called()))).load()
    with pytest.raises(pickle.UnpicklingError, match="skeleton names"):
        _OnlySharedTd(io.BytesIO(pickle.dumps(_Forged()))).load()
    assert not _RAN
    # a real tree (a non-tensor, a lazy stack, a leaf outside the buffer) loads through it
    td = shared_td.TensorDict(a=torch.zeros(2), text="hi", n={"b": torch.ones(2)},
                              stack=shared_td.LazyStackedTensorDict(shared_td.TensorDict(x=torch.ones(1)),
                                                                    shared_td.TensorDict(x=torch.zeros(1)), stack_dim=0),
                              batch_size=[]).consolidate().unlock_()
    td["extra"] = torch.arange(3)
    assert _OnlySharedTd(io.BytesIO(pickle.dumps(td))).load().get("text") == "hi"


# ---------------------------------------------- 4: a sub-tree locked by its parent
@pytest.mark.parametrize("lib", ["shared_td", "tensordict"])
@pytest.mark.parametrize("dumps, loads", [(pickle.dumps, pickle.loads), (ForkingPickler.dumps, ForkingPickler.loads)])
def test_a_sub_tree_locked_by_its_parent_arrives_locked(lib, dumps, loads):
    # before: td["n"] of a consolidated tree (locked because its parent is) arrived
    # unlocked; tensordict 0.15.3, and shared_td's shared and file variants, lock it
    T = _library(lib)
    td = T.TensorDict({"a": torch.zeros(4), "n": {"b": torch.zeros(4), "m": {"c": torch.zeros(4)}}},
                      batch_size=[4]).consolidate()
    got = loads(dumps(td["n"]))
    assert got.is_locked and got["m"].is_locked and (got["m", "c"] == 0).all()
    got.unlock_()  # its own lock: the receiver may lift it
    whole = loads(dumps(td))  # a tree locked as a whole still arrives unlocked
    assert not whole.is_locked and not whole["n"].is_locked


# ----------------------------------------------------------- nit: a counter's words
def test_a_counter_whose_sender_died_says_so_as_a_counter():
    # before: the counter went as its segment, whose error spoke of "the memory of
    # tensors" and of publishing tensors through a Coordinator
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=send_counter_bytes, args=(sender,))
    child.start()
    assert receiver.poll(WAIT)
    data = receiver.recv_bytes()
    assert finish(child) == 0
    with pytest.raises(SegmentUnavailableError, match="SharedCounter") as raised:
        ForkingPickler.loads(data)
    assert "memory of tensors" not in str(raised.value) and "A SharedCounter lives" in str(raised.value)
