"""Gaps of the saved layout (audit of session 21, contract finding 5 and its low notes).

* A lazy stack with a lost member directory is a FormatError naming it, never a shorter
  stack: shared_td records the member count (``"_shared_td_members"``, which tensordict
  0.15.3 ignores) and checks it; a save without it (tensordict's) is read up to the first
  missing member, and a gap before a member that is there is a FormatError too.
* ``LazyStackedTensorDict(tc, tc)`` writes its tensorclass members as tensorclass nodes
  (as tensordict 0.15.3 does), and a load (of either library's save) gives them back so.
* ``consolidate(filename=f).memmap_(p)``: the leaves are memory-mapped over ``f``, so the
  page's ``copy_existing`` rule refuses the copy without ``copy_existing=True``
  (tensordict 0.15.3 copies them silently).
* A directory where a leaf file goes: an IsADirectoryError naming the key, the path and
  the fix.
Compared with tensordict 0.15.3 side by side where the behaviour is shared.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch

import shared_td
from shared_td.errors import FormatError
from shared_td.persist import format as fmt
from shared_td.persist.survey import survey
from tests.reference import needs_tensordict, tensordict


def _stack(lib, n=3):
    return lib.LazyStackedTensorDict(*[lib.TensorDict(a=torch.full((2,), float(i)), batch_size=[2])
                                       for i in range(n)])


def _meta(path):
    with open(os.path.join(path, fmt.META), encoding="utf-8") as file:
        return json.load(file)


def _load(lib, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tensordict's FutureWarnings
        return lib.TensorDict.load_memmap(path)


# ------------------------------------------------------------ 1. a lost member of a lazy stack

def test_the_member_count_is_written_and_tensordict_ignores_it(tmp_path):
    _stack(shared_td).memmap_(tmp_path / "s")
    assert _meta(tmp_path / "s")[fmt.STACK_MEMBERS] == 3
    shared_td.LazyStackedTensorDict(stack_dim=1, batch_size=[2]).memmap_(tmp_path / "empty")
    assert _meta(tmp_path / "empty")[fmt.STACK_MEMBERS] == 0
    assert shared_td.load_memmap(tmp_path / "empty").batch_size == (2, 0)
    if tensordict is not None:
        assert _load(tensordict, tmp_path / "s")["a"][:, 0].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("lost", ["1", "2"])
def test_a_lost_member_is_an_error_naming_it(lost, tmp_path):
    _stack(shared_td).memmap_(tmp_path / "s")
    shutil.rmtree(tmp_path / "s" / lost)
    with pytest.raises(FormatError, match=f"member {lost} of 3 .*{tmp_path / 's' / lost}"):
        shared_td.load_memmap(tmp_path / "s")
    problems = [p for p in survey(str(tmp_path / "s")).problems if p.severity == "error"]
    assert problems and fmt.STACK_MEMBERS in problems[0].message


def test_a_lost_member_of_a_nested_stack_and_by_subpath(tmp_path):
    shared_td.TensorDict(s=_stack(shared_td), batch_size=[3]).memmap_(tmp_path / "t")
    shutil.rmtree(tmp_path / "t" / "s" / "0")
    with pytest.raises(FormatError, match="member 0 of 3"):
        shared_td.load_memmap(tmp_path / "t")
    with pytest.raises(FormatError, match="member 0 of 3"):
        shared_td.load_memmap(tmp_path / "t", subpath=("s", "1"))


@pytest.mark.parametrize("lib", [pytest.param("shared_td"), pytest.param("tensordict", marks=needs_tensordict)])
def test_a_save_without_the_count_loads_as_before_and_a_gap_is_an_error(lib, tmp_path):
    """tensordict's save (or shared_td's without the count): read up to the first missing
    member; a missing member before one that is there is a FormatError (tensordict 0.15.3
    drops it and every member after it)."""
    writer = shared_td if lib == "shared_td" else tensordict
    for name in ("whole", "end", "gap"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _stack(writer).memmap_(tmp_path / name)
        meta = _meta(tmp_path / name)
        meta.pop(fmt.STACK_MEMBERS, None)
        (tmp_path / name / fmt.META).write_text(json.dumps(meta))
    shutil.rmtree(tmp_path / "end" / "2")
    shutil.rmtree(tmp_path / "gap" / "1")
    assert shared_td.load_memmap(tmp_path / "whole").batch_size == (3, 2)
    assert shared_td.load_memmap(tmp_path / "end").batch_size == (2, 2)  # as tensordict: no count
    with pytest.raises(FormatError, match=f"member 1 of this lazy stack is missing: no directory {tmp_path / 'gap' / '1'}"):
        shared_td.load_memmap(tmp_path / "gap")
    if tensordict is not None:
        assert _load(tensordict, tmp_path / "gap").batch_size == (1, 2)  # silently shorter


@pytest.mark.parametrize("value,reason", [(-1, "not a member count"), (1.0, "not a member count"),
                                          (True, "not a member count"), (2, "written only for a stack")])
def test_a_bad_member_count_is_a_format_error(value, reason, tmp_path):
    shared_td.LazyStackedTensorDict(stack_dim=0).memmap_(tmp_path / "s")
    meta = _meta(tmp_path / "s")
    meta[fmt.STACK_MEMBERS] = value
    (tmp_path / "s" / fmt.META).write_text(json.dumps(meta))
    with pytest.raises(FormatError, match=reason):
        shared_td.load_memmap(tmp_path / "s")


def test_a_shorter_save_over_a_longer_one_loads_its_own_members(tmp_path):
    _stack(shared_td, 4).memmap_(tmp_path / "s")
    _stack(shared_td, 2).memmap_(tmp_path / "s")
    assert shared_td.load_memmap(tmp_path / "s").batch_size == (2, 2)
    assert not (tmp_path / "s" / "2").exists()


# ------------------------------------------------ 2. tensorclass members of a lazy stack

@shared_td.tensorclass
class Pair:
    x: torch.Tensor
    note: str


def _pairs(cls):
    return [cls(x=torch.zeros(2), note="a", batch_size=[2]), cls(x=torch.ones(2), note="b", batch_size=[2])]


def test_tensorclass_members_are_written_as_tensorclasses(tmp_path):
    first, second = _pairs(Pair)
    lazy = shared_td.LazyStackedTensorDict(first, second)
    lazy.memmap_(tmp_path / "s")
    assert _meta(tmp_path / "s" / "0")["_type"] == str(Pair)
    assert (tmp_path / "s" / "0" / fmt.TENSORCLASS_CHILD / fmt.META).exists()
    assert first.is_memmap() and first.x.data_ptr() == lazy.tensordicts[0]["x"].data_ptr()
    loaded = shared_td.load_memmap(tmp_path / "s")
    assert loaded.get("note").tolist() == [["a", "a"], ["b", "b"]]
    loaded.insert(0, shared_td.TensorDict(x=torch.ones(2), note="c", batch_size=[2], device="cpu"))
    loaded.memmap(tmp_path / "loaded", copy_existing=True)  # loaded with its classes, wherever they are now
    assert [_meta(tmp_path / "loaded" / i)["_type"] for i in "012"] == [fmt.TENSORDICT_TYPE, str(Pair), str(Pair)]
    copy = lazy.memmap(tmp_path / "copy", copy_existing=True)  # a copy keeps the classes too
    assert _meta(tmp_path / "copy" / "1")["_type"] == str(Pair)
    copy.memmap(tmp_path / "again", copy_existing=True)
    assert _meta(tmp_path / "again" / "1")["_type"] == str(Pair)


def test_a_mixed_stack_writes_each_member_as_it_is(tmp_path):
    pair = _pairs(Pair)[0]
    shared_td.LazyStackedTensorDict(pair, shared_td.TensorDict(x=torch.ones(2), note="t", batch_size=[2])).memmap_(tmp_path / "s")
    assert [_meta(tmp_path / "s" / i)["_type"] for i in "01"] == [str(Pair), fmt.TENSORDICT_TYPE]


@needs_tensordict
def test_tensordict_save_of_tensorclass_members_loads_with_them_and_back(tmp_path):
    class TDPair(tensordict.TensorClass):
        x: torch.Tensor
        note: str
    TDPair.__qualname__ = Pair.__qualname__  # the same name as this module's shared_td class
    assert str(TDPair) == str(Pair)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensordict.LazyStackedTensorDict(*_pairs(TDPair)).memmap_(tmp_path / "td")
    loaded = shared_td.load_memmap(tmp_path / "td")
    assert loaded.get("note").tolist() == [["a", "a"], ["b", "b"]]
    loaded.memmap(tmp_path / "back", copy_existing=True)  # shared_td's save of it: tensordict reads TDPair members
    back = _load(tensordict, tmp_path / "back")
    assert [type(m) for m in back.tensordicts] == [TDPair, TDPair]
    assert back[1].note == "b"


# -------------------------------------------------- 3. a tree consolidated into a file

def _consolidated(lib, path):
    return lib.TensorDict(a=torch.arange(3.0), n={"b": torch.ones(3)}, batch_size=[3]).consolidate(
        filename=str(path))


def test_memmap_of_a_consolidated_file_needs_copy_existing(tmp_path):
    """The page: a leaf that already is a memory-mapped tensor with a file at another path
    raises a RuntimeError unless copy_existing=True (tensordict 0.15.3 copies it)."""
    td = _consolidated(shared_td, tmp_path / "c.bin")
    with pytest.raises(RuntimeError, match="copy_existing=True"):
        td.memmap_(tmp_path / "p")
    assert not td.is_memmap()
    out = _consolidated(shared_td, tmp_path / "c2.bin").memmap_(tmp_path / "q", copy_existing=True)
    out["a"][0] = 9.0
    assert shared_td.load_memmap(tmp_path / "q")["a"].tolist() == [9.0, 1.0, 2.0]
    if tensordict is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _consolidated(tensordict, tmp_path / "t.bin").memmap_(str(tmp_path / "r"))  # no error there


# -------------------------------------------------- 4. a directory where a leaf file goes

@pytest.mark.parametrize("key", ["a", ("n", "a")])
def test_a_directory_in_place_of_a_leaf_file_names_key_path_and_fix(key, tmp_path):
    shared_td.TensorDict(a=torch.zeros(3), n={"a": torch.zeros(3)}, b=torch.zeros(3), batch_size=[3]).memmap(tmp_path)
    path = os.path.join(tmp_path, *((key,) if isinstance(key, str) else key)) + ".memmap"
    os.unlink(path)
    os.mkdir(path)
    td = shared_td.TensorDict(a=torch.ones(3), n={"a": torch.ones(3)}, b=torch.ones(3), batch_size=[3])
    with pytest.raises(IsADirectoryError, match=f"key 'a' to {path}: it is a directory.*Remove that directory"):
        td.memmap_(tmp_path)
