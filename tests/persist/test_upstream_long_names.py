"""Saves whose name is close to the 255-byte limit of a file name: the lock file and
the temporaries made beside them must still fit (tensordict 0.15.3 saves to such names;
a difference found by running tensordict's own archive tests against shared_td)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import shared_td
from shared_td.persist import atomic
from shared_td.persist import format as fmt
from tests.reference import LIBS

LENGTHS = [220, 246, 255]


def small(lib):
    return lib.TensorDict({"a": torch.arange(3.0), "nested": {"b": torch.ones(3)}}, batch_size=[3])


def long_name(tmp_path, length, suffix=""):
    if os.pathconf(tmp_path, "PC_NAME_MAX") < length:
        pytest.skip("this file system's names are shorter")
    return tmp_path / ("a" * (length - len(suffix)) + suffix)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("existing", [False, True])
def test_archive_of_a_memory_mapped_tree_with_a_long_name(lib, tmp_path, length, existing):
    mapped = small(lib).memmap(tmp_path / "source")
    archive = long_name(tmp_path, length, ".tdz")
    if existing:
        archive.write_bytes(b"existing contents")
    mapped.save(archive)
    assert (lib.TensorDict.load_memmap(archive) == small(lib)).all()


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("existing", [False, True])
def test_archive_with_a_long_name(tmp_path, length, existing):
    # tensordict 0.15.3 fails here ("File name too long": its temporary's name is the
    # archive's and more) unless the tree is memory-mapped already
    archive = long_name(tmp_path, length, ".tdz")
    if existing:
        small(shared_td).save(archive)
    small(shared_td).save(archive)
    assert (shared_td.TensorDict.load_memmap(archive) == small(shared_td)).all()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("length", LENGTHS)
def test_pack_memmap_to_a_long_name(lib, tmp_path, length):
    small(lib).memmap(tmp_path / "source")
    archive = long_name(tmp_path, length, ".tdz")
    lib.pack_memmap(tmp_path / "source", archive)
    assert (lib.TensorDict.load_memmap(archive) == small(lib)).all()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("length", LENGTHS)
def test_consolidate_to_a_long_name(lib, tmp_path, length):
    path = long_name(tmp_path, length, ".bin")
    small(lib).consolidate(filename=path)
    assert (lib.TensorDict.from_consolidated(path) == small(lib)).all()


@pytest.mark.parametrize("length", LENGTHS)
def test_atomic_rewrite_of_a_long_directory_name(tmp_path, length):
    prefix = long_name(tmp_path, length)
    small(shared_td).memmap(prefix)
    changed = small(shared_td)
    changed["a"] += 1
    changed.memmap(prefix, atomic=True)
    assert (shared_td.load_memmap(prefix)["a"] == torch.arange(3.0) + 1).all()
    assert all(len(os.fsencode(entry)) <= 255 for entry in os.listdir(tmp_path))


def test_sibling_names_fit_and_stay_distinct(tmp_path):
    one, other = "a" * 250, "a" * 249 + "b"  # the same start: told apart by the hash
    assert fmt.sibling_stem(one) != fmt.sibling_stem(other)
    for name in (one, other, "é" * 127):
        for sibling in (os.path.basename(fmt.lock_path(str(tmp_path / name))), atomic.temporary_name(name)):
            assert len(os.fsencode(sibling)) <= 255
    assert fmt.sibling_stem("short") == "short"  # names that fit are kept whole


def test_gc_removes_a_dead_writers_temporary_of_a_long_name(tmp_path):
    archive = long_name(tmp_path, 250, ".tdz")
    small(shared_td).save(archive)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    assert dead.wait(timeout=60) == 0
    temporary = tmp_path / atomic.temporary_name(archive.name).replace(f"-{os.getpid()}-", f"-{dead.pid}-")
    temporary.write_bytes(b"half an archive")
    removed = shared_td.gc(archive)
    assert removed == [str(temporary)]
    assert not temporary.exists()
    assert (shared_td.load_memmap(archive) == small(shared_td)).all()
