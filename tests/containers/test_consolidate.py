"""consolidate() / is_consolidated(): one storage for a whole tree, and its pickling."""
from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch

from tests.containers.consolidate_children import add_one_and_report, unpickle_and_sum
from tests.processes import WAIT, finish
from shared_td import LazyStackedTensorDict, MemoryMappedTensor, TensorDict
from shared_td.containers.tensorclass import tensorclass


@tensorclass
class Step:
    obs: torch.Tensor
    note: str


def _tree() -> TensorDict:
    return TensorDict(
        a=torch.arange(6, dtype=torch.float32).reshape(3, 2),
        flag=torch.tensor([True, False, True]),
        big=torch.randn(3, 40_000),  # above the packing threshold: its own aligned place
        nested=TensorDict(c=torch.arange(3, dtype=torch.int16), text="hello", batch_size=[3]),
        empty=torch.zeros(3, 0),
        batch_size=[3],
    )


def _storages(td) -> set:
    return {leaf.untyped_storage().data_ptr()
            for leaf in td.values(include_nested=True, leaves_only=True) if leaf.numel()}


@pytest.mark.parametrize("mode", ["plain", "shared", "file"])
def test_values_equal_and_one_storage(mode, tmp_path):
    td = _tree()
    kwargs = {"plain": {}, "shared": {"share_memory": True},
              "file": {"filename": tmp_path / "tree.bin"}}[mode]
    out = td.consolidate(**kwargs)
    assert (out == td).all()
    assert out["nested", "text"] == "hello"
    assert len(_storages(out)) == 1
    assert out.is_consolidated() and not td.is_consolidated()
    assert out.is_locked
    for leaf in out.values(include_nested=True, leaves_only=True):
        assert leaf.is_contiguous()
        assert leaf.storage_offset() * leaf.element_size() % leaf.element_size() == 0
    if mode != "plain":
        assert all(isinstance(v, MemoryMappedTensor) for v in out.values(True, True))
    # the leaves are views: an in-place write shows through the storage
    out["a"][0, 0] = 100.0
    assert out["a"][0, 0] == 100.0 and td["a"][0, 0] == 0.0


def test_same_layout_as_anonymous_memmap():
    td = _tree()
    shared = td.consolidate(share_memory=True)
    memmapped = td.memmap()
    for key in td.keys(include_nested=True, leaves_only=True):
        if td[key].numel():
            assert shared[key]._byte_offset() == memmapped[key]._byte_offset(), key
    assert len({leaf._backing.key for leaf in memmapped.values(True, True) if leaf.numel()}) == 1
    # memmap_() of the shared consolidated tree keeps its one segment (no copy)
    leaves = dict(shared.items(True, True))
    shared.unlock_()
    shared.memmap_()
    assert shared.is_memmap() and shared.is_consolidated()
    assert all(shared[key] is leaf for key, leaf in leaves.items() if leaf.numel())


def test_lazy_stack_and_tensorclass():
    lazy = LazyStackedTensorDict(TensorDict(x=torch.ones(2)), TensorDict(x=torch.zeros(2), y=torch.ones(1)))
    out = lazy.consolidate()
    assert isinstance(out, LazyStackedTensorDict) and out.is_consolidated()
    assert len(_storages(out)) == 1
    assert (out.tensordicts[1]["y"] == 1).all() and (out.tensordicts[0]["x"] == 1).all()
    again = pickle.loads(pickle.dumps(out))
    assert again.is_consolidated() and (again.tensordicts[1]["x"] == 0).all()

    step = Step(obs=torch.arange(4.0).reshape(2, 2), note="go", batch_size=[2])
    out = step.consolidate()
    assert type(out) is Step and out.note == "go" and (out.obs == step.obs).all()
    assert out.is_consolidated() and not step.is_consolidated()
    again = pickle.loads(pickle.dumps(out))
    assert type(again) is Step and again.is_consolidated() and (again.obs == step.obs).all()


def test_pickle_is_one_buffer():
    leaves = {f"k{i}": torch.randn(1000) for i in range(20)}
    td = TensorDict(leaves, nested={"more": torch.randn(5000)})
    payload = sum(v.numel() * 4 for v in td.values(True, True))
    out = td.consolidate()
    for protocol in (4, 5):
        data = pickle.dumps(out, protocol=protocol)
        assert payload <= len(data) < payload + 8000, (protocol, len(data))
        again = pickle.loads(data)
        assert (again == td).all() and again.is_consolidated() and not again.is_locked  # as tensordict
        assert len(_storages(again)) == 1
        again["k0"][0] = 5.0  # its buffer is writable and its own
        assert out["k0"][0] != 5.0 or td["k0"][0] == 5.0
    # the nested nodes come back unlocked too (tensordict 0.15.3: the same)
    again = pickle.loads(pickle.dumps(out))
    assert not again["nested"].is_locked
    unlocked = pickle.loads(pickle.dumps(out.unlock_()))
    assert not unlocked.is_locked and not unlocked["nested"].is_locked
    # a sub-tree and a single leaf's tree carry the buffer once, not once per leaf
    assert len(pickle.dumps(out["nested"])) < 2 * len(pickle.dumps(out))


def test_replaced_entry_is_no_longer_consolidated():
    out = _tree().consolidate()
    out.unlock_()
    out["a"] = torch.full((3, 2), 7.0)
    assert not out.is_consolidated()
    again = pickle.loads(pickle.dumps(out))
    assert not again.is_consolidated()
    assert (again["a"] == 7).all() and (again["nested", "c"] == torch.arange(3)).all()


def test_filename_round_trip(tmp_path):
    td = _tree()
    path = tmp_path / "one.bin"
    out = td.consolidate(filename=path)
    out["nested", "c"][1] = 42
    assert path.stat().st_size >= sum(v.numel() * v.element_size() for v in td.values(True, True))
    # a pickle sends the file by reference: the receiver maps the same file
    again = pickle.loads(pickle.dumps(out))
    assert again["nested", "c"][1] == 42
    again["a"][2, 1] = -1.0
    assert out["a"][2, 1] == -1.0
    assert {v.filename for v in again.values(True, True) if v.numel()} == {str(path)}


def test_shared_seen_by_spawned_child_without_copy():
    out = TensorDict(a=torch.zeros(4), b={"c": torch.zeros(2, dtype=torch.int64)}).consolidate(share_memory=True)
    segment = out["a"]._backing.key
    ctx = multiprocessing.get_context("spawn")
    answers = ctx.Queue()
    child = ctx.Process(target=add_one_and_report, args=(out, answers))
    child.start()
    consolidated, segments = answers.get(timeout=WAIT)
    assert finish(child) == 0
    assert consolidated and segments == [segment]
    assert (out["a"] == 1).all() and (out["b", "c"] == 1).all()


def test_plain_pickle_to_a_child():
    td = _tree()
    out = td.consolidate()
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=unpickle_and_sum, args=(child_end,))
    child.start()
    parent_end.send_bytes(pickle.dumps(out))
    assert parent_end.poll(WAIT)
    consolidated, total = parent_end.recv()
    assert finish(child) == 0
    assert consolidated
    assert total == pytest.approx(sum(float(v.double().sum()) for v in td.values(True, True)))


def test_side_by_side_with_tensordict():
    tensordict = pytest.importorskip("tensordict")
    theirs = tensordict.TensorDict(a=torch.arange(3.0), b={"c": torch.ones(3, 2, dtype=torch.int64)},
                                   batch_size=[3]).consolidate()
    ours = TensorDict(a=torch.arange(3.0), b={"c": torch.ones(3, 2, dtype=torch.int64)},
                      batch_size=[3]).consolidate()
    assert ours.is_consolidated() == theirs.is_consolidated() is True
    assert ours.is_locked == theirs.is_locked is True
    assert (ours["b", "c"] == theirs["b", "c"]).all()
    assert len(pickle.dumps(ours)) <= len(pickle.dumps(theirs)) * 2


def test_copy_is_shallow_and_deepcopy_is_consolidated():
    import copy

    out = _tree().consolidate()
    shallow = copy.copy(out)  # copy(), as tensordict: a new structure, unlocked, the same leaves
    assert shallow["a"] is out["a"] and not shallow.is_locked
    deep = copy.deepcopy(out)
    assert deep.is_consolidated() and (deep == out).all()
    assert _storages(deep).isdisjoint(_storages(out))


def test_values_of_every_kind_of_leaf():
    # dtypes of one size interleaved (float32/int32), a transposed leaf, a conjugate,
    # a negative view, a 0-dim one and one that requires grad: values as they read
    source = TensorDict(
        f=torch.ones(2, 3).t(), i=torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),
        g=torch.randn(3, requires_grad=True), c=torch.tensor([1 + 2j]).conj(),
        n=torch.tensor([1.0, 2.0])._neg_view(), z=torch.tensor(5), b=torch.tensor([True]),
        h=torch.arange(3, dtype=torch.float16),
    )
    for out in (source.consolidate(), pickle.loads(pickle.dumps(source.consolidate()))):
        for key, value in source.items():
            assert torch.equal(out[key], value.detach().resolve_conj().resolve_neg()), key
        assert len(_storages(out)) == 1


def test_replaced_entries_that_view_the_buffer_pickle_with_their_values():
    out = TensorDict(c=torch.tensor([1 + 2j, 3 - 1j]), f=torch.arange(6.0), g=torch.arange(4.0)).consolidate()
    out.unlock_()
    out["c"] = out["c"].conj()  # a conjugate view of the buffer: the flag is not in the bytes
    out["g"] = out["f"][1:5]  # a contiguous part of another leaf
    out["t"] = out["f"].reshape(2, 3).t()  # not contiguous
    out["n"] = out["f"][:2]._neg_view()
    again = pickle.loads(pickle.dumps(out))
    for key in ("c", "g", "t", "n"):
        assert torch.equal(again[key].resolve_conj().resolve_neg(), out[key].resolve_conj().resolve_neg()), key


def test_filename_with_a_size_that_is_not_a_whole_number_of_every_dtype(tmp_path):
    # 8 bytes of float32 then 3 of int8: 11 bytes, not a whole number of float32
    td = TensorDict(a=torch.arange(2.0), b=torch.arange(3, dtype=torch.int8), c=torch.arange(3, dtype=torch.int64))
    out = td.consolidate(filename=tmp_path / "odd.bin")
    assert (out == td).all() and out.is_consolidated()
    assert (pickle.loads(pickle.dumps(out)) == td).all()


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_conj_or_neg_view_of_the_buffer_is_not_consolidated(tmp_path, view):
    # its bytes are the buffer's, its values are not: counted as consolidated, a
    # consolidate() into the same file only rewrote the metadata, and the file held the
    # values without the conjugation
    path = tmp_path / "td.bin"
    td = TensorDict(z=torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)).consolidate(filename=path)
    td.unlock_()
    td["v"] = td["z"].conj() if view == "conj" else td["z"]._neg_view()
    assert not td.is_consolidated()
    td.consolidate(filename=path)
    assert TensorDict.from_consolidated(path)["v"].tolist() == td["v"].tolist()
