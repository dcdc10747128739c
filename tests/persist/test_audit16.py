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
