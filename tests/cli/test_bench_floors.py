"""The floors of the tree benchmarks do the same work as the library: the same bytes
mapped, the same files written, the same swap (else a ratio to them means nothing)."""
from __future__ import annotations

import os

import torch

import shared_td
from shared_td.bench import floors
from shared_td.bench.libraries import build_tree


def _leaves(td) -> list[torch.Tensor]:
    return list(td.values(include_nested=True, leaves_only=True))


def _saved(tmp_path, name: str = "saved"):
    td = build_tree(shared_td, 5)
    td["extra", "ints"] = torch.arange(8, dtype=torch.int16).reshape(4, 2)
    path = str(tmp_path / name)
    td.memmap_(path)
    return td, path


def test_load_floor_maps_every_leaf_with_its_dtype_shape_and_bytes(tmp_path):
    td, path = _saved(tmp_path)
    views = floors.load_tree(path)
    expected = {(str(leaf.dtype), tuple(leaf.shape), leaf.numpy().tobytes()) for leaf in _leaves(td)}
    assert len(views) == len(_leaves(td)) == 11
    assert {(str(v.dtype), tuple(v.shape), v.numpy().tobytes()) for v in views} == expected
    views[0].fill_(7)  # a shared mapping of the file itself
    assert any(bool((leaf == 7).all()) for leaf in _leaves(shared_td.TensorDict.load_memmap(path)))


def test_write_floor_writes_a_save_that_loads_equal(tmp_path):
    td, path = _saved(tmp_path)
    nodes = floors.saved_nodes(path)
    views = floors.write_tree(nodes, str(tmp_path / "copy"))
    assert len(views) == 11 and floors.write_tree(nodes, str(tmp_path / "bare"), map_after=False) == []
    for copy in ("copy", "bare"):
        assert (shared_td.TensorDict.load_memmap(str(tmp_path / copy)) == td).all()


def test_checked_floors_map_and_write_the_same_bytes(tmp_path):
    td, path = _saved(tmp_path)
    expected = sorted((str(v.dtype), tuple(v.shape), v.numpy().tobytes()) for v in floors.load_tree(path))
    loaded = floors.load_tree_checked(path)
    assert sorted((str(v.dtype), tuple(v.shape), v.numpy().tobytes()) for v in loaded) == expected
    views = floors.write_tree_checked(floors.saved_nodes(path), str(tmp_path / "copy"))
    assert sorted((str(v.dtype), tuple(v.shape), v.numpy().tobytes()) for v in views) == expected
    assert (shared_td.TensorDict.load_memmap(str(tmp_path / "copy")) == td).all()
    views[0].fill_(3)  # a shared mapping of the file written
    assert any(bool((leaf == 3).all()) for leaf in _leaves(shared_td.TensorDict.load_memmap(str(tmp_path / "copy"))))


def test_rewrite_floor_swaps_the_new_version_in_and_removes_the_old(tmp_path):
    td, path = _saved(tmp_path)
    nodes = floors.saved_nodes(path)
    old_inode = os.stat(path).st_ino
    staging = str(tmp_path / ".staging")
    floors.rewrite_tree(nodes, path, staging)
    assert os.stat(path).st_ino != old_inode and not os.path.exists(staging)
    assert (shared_td.TensorDict.load_memmap(path) == td).all()


def test_anonymous_floor_copies_every_leaf_into_one_segment(tmp_path):
    sources = _leaves(build_tree(shared_td, 3)) + [torch.arange(6, dtype=torch.int64).reshape(2, 3)]
    views = floors.share_anonymously(sources)
    assert all(torch.equal(v, s) and v.dtype == s.dtype for v, s in zip(views, sources))
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1


def test_attach_floor_views_the_segment_at_each_leaf_offset():
    td = shared_td.TensorDict(a=torch.arange(4.0), b=torch.arange(3, dtype=torch.int64)).memmap_()
    leaves = _leaves(td)
    segment = leaves[0]._backing
    layout = [(leaf._byte_offset(), leaf.dtype, tuple(leaf.shape)) for leaf in leaves]
    views = floors.map_views(f"/proc/{os.getpid()}/fd/{segment.fd}", layout, segment.nbytes)
    assert all(torch.equal(v, leaf) for v, leaf in zip(views, leaves))
    views[0][0] = 42.0  # the same memory
    assert leaves[0][0] == 42.0


def test_checked_load_floor_maps_the_same_leaves(tmp_path):
    _, path = _saved(tmp_path)
    plain, checked = floors.load_tree(path), floors.load_tree_checked(path)
    assert sorted(v.numpy().tobytes() for v in plain) == sorted(v.numpy().tobytes() for v in checked)


def test_append_floor_grows_a_flat_save_by_one_row_as_append_memmap_does(tmp_path):
    rows = shared_td.TensorDict(a=torch.arange(6.0).reshape(3, 2), b=torch.arange(3), batch_size=[3])
    for name in ("floor", "library"):
        rows.memmap(str(tmp_path / name))
    floors.append_rows(str(tmp_path / "floor"))
    shared_td.append_memmap(str(tmp_path / "library"), rows[:1].clone().zero_())
    floor, library = (shared_td.load_memmap(str(tmp_path / name)) for name in ("floor", "library"))
    assert floor.batch_size == library.batch_size == torch.Size([4])
    assert all(torch.equal(floor[key], library[key]) for key in ("a", "b"))
