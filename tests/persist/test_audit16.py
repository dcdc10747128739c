"""What the session-16 audit of saving found, each tested where it was found:

1. a save of a lazy stack into a directory that holds entries named as further members
   (``2/``, ``3/``) removed them, whatever they were: a user's own directories of
   results in an experiment folder were lost. Only the members of an earlier save are
   removed now; anything else is refused before a byte is written.
"""
from __future__ import annotations

import os

import pytest
import torch

from shared_td import LazyStackedTensorDict, TensorDict, load_memmap


def _stack(length: int, value: float) -> LazyStackedTensorDict:
    return LazyStackedTensorDict(*[TensorDict(x=torch.full((2,), value), batch_size=[2]) for _ in range(length)])


def _listing(directory) -> dict:
    """Every path below ``directory`` with its bytes (None for a directory)."""
    found = {}
    for where, dirs, names in os.walk(directory):
        for name in dirs:
            found[os.path.relpath(os.path.join(where, name), directory)] = None
        for name in names:
            with open(os.path.join(where, name), "rb") as file:
                found[os.path.relpath(os.path.join(where, name), directory)] = file.read()
    return found


# ------------------------------------------------------------- 1. a stack's further members

@pytest.mark.parametrize("nested", [False, True])
def test_a_users_directories_named_as_members_are_never_removed(tmp_path, nested):
    folder = tmp_path / "experiment"
    stack_dir = folder / "s" if nested else folder
    for name in ("2", "3"):
        os.makedirs(stack_dir / name)
        (stack_dir / name / "results.csv").write_text("precious\n")
    (folder / "notes.txt").write_text("mine\n")
    before = _listing(folder)
    tree = TensorDict(s=_stack(2, 1.0), batch_size=[]) if nested else _stack(2, 1.0)
    with pytest.raises(RuntimeError, match=r"holds '2', which a load would read as a member of this stack of 2.*"
                                           r"is not a save: it has no meta.json.*Nothing was written"):
        tree.memmap_(folder)
    assert _listing(folder) == before and not tree.is_memmap()


def test_a_directory_named_as_a_member_inside_an_earlier_save_is_refused(tmp_path):
    prefix = tmp_path / "p"
    _stack(2, 1.0).memmap_(prefix)
    os.makedirs(prefix / "2")
    (prefix / "2" / "results.csv").write_text("precious\n")  # not a save: the user's
    before = _listing(prefix)
    with pytest.raises(RuntimeError, match=r"p/2 is not a save: it has no meta.json"):
        _stack(2, 5.0).memmap_(prefix)
    assert _listing(prefix) == before


def test_a_symlink_named_as_a_member_is_refused(tmp_path):
    prefix, elsewhere = tmp_path / "p", tmp_path / "elsewhere"
    _stack(3, 1.0).memmap_(elsewhere)
    _stack(2, 1.0).memmap_(prefix)
    os.symlink(elsewhere / "2", prefix / "2")
    with pytest.raises(RuntimeError, match=r"p/2 is a symlink"):
        _stack(2, 5.0).memmap_(prefix)
    assert os.path.islink(prefix / "2") and (load_memmap(elsewhere)["x"] == 1.0).all()


def test_the_members_of_an_earlier_longer_save_are_still_removed(tmp_path):
    prefix = tmp_path / "p"
    _stack(4, 1.0).memmap_(prefix)
    _stack(2, 2.0).memmap_(prefix)
    assert sorted(os.listdir(prefix)) == ["0", "1", "meta.json"]
    assert load_memmap(prefix)["x"].tolist() == [[2.0, 2.0]] * 2


# ------------------------------------------------------------- 2. make_memmap's rewrite

def _add_key_after_loading(prefix: str, key: str, loaded, go, outcomes) -> None:
    """A child: load the save and memory-map it in place, say so, wait for ``go``, add
    ``key`` with make_memmap; report whether the save had changed meanwhile."""
    import shared_td

    td = load_memmap(prefix).memmap_()  # (its leaves kept: their files)
    loaded.put(key)
    go.wait(30)
    try:
        td.make_memmap(key, (3,)).fill_(1.0)
        outcomes.put((key, "added"))
    except shared_td.SaveChangedError:
        outcomes.put((key, "refused"))


def test_processes_adding_keys_at_once_lose_none(tmp_path):
    """Each process loaded the save, then all add a key at once: the rewrite of
    meta.json from a stale view dropped the keys the others had added, though each
    make_memmap returned (tensordict's defect, spec §12.3). Each rewrite now checks,
    under the node's lock, that meta.json still describes its view: what was added is
    in the save, what was refused left no file."""
    import multiprocessing

    from tests.processes import WAIT, finish

    prefix = str(tmp_path / "buf")
    TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(prefix)
    ctx = multiprocessing.get_context("fork")
    loaded, go, outcomes = ctx.Queue(), ctx.Event(), ctx.Queue()
    keys = [f"k{i}" for i in range(4)]
    children = [ctx.Process(target=_add_key_after_loading, args=(prefix, key, loaded, go, outcomes))
                for key in keys]
    for child in children:
        child.start()
    try:
        assert sorted(loaded.get(timeout=WAIT) for _ in keys) == keys
        go.set()
        said = dict(outcomes.get(timeout=WAIT) for _ in keys)
    finally:
        codes = [finish(child) for child in children]
    assert codes == [0] * len(keys)
    added = sorted(key for key, outcome in said.items() if outcome == "added")
    again = load_memmap(prefix)
    assert added and sorted(again.keys()) == ["a", *added] and all((again[key] == 1.0).all() for key in added)
    assert sorted(os.listdir(prefix)) == sorted(["a.memmap", "meta.json", *(f"{key}.memmap" for key in added)])


def test_make_memmap_after_an_atomic_rewrite_refuses_and_writes_nothing(tmp_path):
    import shared_td

    prefix = str(tmp_path / "buf")
    TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(prefix)
    view = load_memmap(prefix).memmap_()
    TensorDict(b=torch.ones(3), batch_size=[3]).memmap(prefix, atomic=True)  # another writer's new version
    before = _listing(prefix)
    with pytest.raises(shared_td.SaveChangedError, match=r"buf/meta.json no longer describes.*Load the save again"):
        view.make_memmap("x", (3,))
    assert _listing(prefix) == before and "x" not in view.keys()
    assert sorted(load_memmap(prefix).keys()) == ["b"]


def test_make_memmap_of_a_nested_key_through_a_new_sub_tensordict(tmp_path):
    prefix = str(tmp_path / "buf")
    td = TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(prefix)
    td.make_memmap(("n", "m", "x"), (3,)).fill_(2.0)
    td.make_memmap(("n", "y"), (3,)).fill_(3.0)
    again = load_memmap(prefix)
    assert again["n", "m", "x"].tolist() == [2.0] * 3 and again["n", "y"].tolist() == [3.0] * 3
