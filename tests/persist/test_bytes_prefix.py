"""A ``bytes`` prefix, at every call that takes one: decoded as the ``os`` module does
(tensordict 0.15.3 fails on it with a TypeError from deep inside); any other non-path
is a TypeError naming the argument, what was given and the fix."""
from __future__ import annotations

import os
import pathlib

import pytest
import torch

import shared_td
from tests.reference import needs_tensordict, tensordict
from shared_td import TensorDict
from shared_td.containers.tensorclass import tensorclass


@tensorclass
class Step:
    obs: torch.Tensor


def _td():
    return TensorDict(a=torch.arange(3.0), n=TensorDict(b=torch.ones(3), batch_size=[3]), batch_size=[3])


WRITERS = {
    "memmap_": lambda td, prefix: td.memmap_(prefix),
    "memmap": lambda td, prefix: td.memmap(prefix),
    "memmap_like": lambda td, prefix: td.memmap_like(prefix),
    "save": lambda td, prefix: td.save(prefix),
    "shared_td.save": lambda td, prefix: shared_td.save(td, prefix),
    "shared_td.memmap": lambda td, prefix: shared_td.memmap(td, prefix),
    "memmap_ return_early": lambda td, prefix: td.memmap_(prefix, num_threads=2, return_early=True).result(30),
    "memmap atomic": lambda td, prefix: td.memmap(prefix, atomic=True),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_takes_a_bytes_prefix(tmp_path, writer):
    prefix = tmp_path / "saved"
    result = WRITERS[writer](_td(), os.fsencode(prefix))
    assert result.saved_path == prefix and isinstance(result.saved_path, pathlib.Path)
    assert result["n"].saved_path == prefix / "n"
    assert (prefix / "a.memmap").is_file()
    assert TensorDict.load_memmap(prefix)["a"].tolist() == ([0.0] * 3 if writer == "memmap_like" else [0.0, 1.0, 2.0])


READERS = {
    "TensorDict.load_memmap": lambda prefix: TensorDict.load_memmap(prefix),
    "TensorDict.load": lambda prefix: TensorDict.load(prefix),
    "shared_td.load_memmap": lambda prefix: shared_td.load_memmap(prefix),
    "shared_td.load": lambda prefix: shared_td.load(prefix),
    "load_memmap out=": lambda prefix: shared_td.load_memmap(prefix, out=_td()),
    "load_memmap_": lambda prefix: _td().load_memmap_(prefix),
    "load_memmap_ into a memmap": lambda prefix: TensorDict.load_memmap(prefix).memmap_().load_memmap_(prefix),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_every_reader_takes_a_bytes_prefix(tmp_path, reader):
    _td().memmap(tmp_path / "saved")
    loaded = READERS[reader](os.fsencode(tmp_path / "saved"))
    assert loaded["a"].tolist() == [0.0, 1.0, 2.0]
    if loaded.is_memmap():
        assert loaded.saved_path == tmp_path / "saved"
    assert not (tmp_path / "saved" / "saved").exists()


def test_an_archive_takes_a_bytes_prefix(tmp_path):
    target = tmp_path / "saved.tdz"
    copy = _td().memmap(os.fsencode(target))  # the .tdz suffix is seen in bytes too
    assert target.is_file() and copy["n", "b"].tolist() == [1.0, 1.0, 1.0]
    assert TensorDict.load_memmap(os.fsencode(target))["a"].tolist() == [0.0, 1.0, 2.0]


def test_a_tensorclass_takes_a_bytes_prefix(tmp_path):
    step = Step(obs=torch.ones(3), batch_size=[3]).memmap(os.fsencode(tmp_path))
    assert step.saved_path == tmp_path / "_tensordict"
    assert isinstance(shared_td.load(os.fsencode(tmp_path)), Step)


def test_bytes_that_are_not_utf8_name_the_same_directory(tmp_path):
    """os.fsdecode's surrogate escapes give back the very bytes on disk."""
    prefix = os.fsencode(tmp_path) + b"/caf\xe9"  # latin-1, invalid UTF-8
    td = _td().memmap_(prefix)
    assert os.listdir(os.fsencode(tmp_path)) == [b"caf\xe9"]
    assert os.fsencode(td.saved_path) == prefix
    assert TensorDict.load_memmap(prefix)["a"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("call", ["memmap_", "memmap", "memmap_like", "load_memmap"])
@pytest.mark.parametrize("prefix", [3, bytearray(b"/tmp/x"), ["data"]])
def test_a_prefix_that_is_no_path_is_a_type_error_naming_it(tmp_path, call, prefix):
    td = _td()
    run = (lambda: TensorDict.load_memmap(prefix)) if call == "load_memmap" else (lambda: getattr(td, call)(prefix))
    with pytest.raises(TypeError) as error:
        run()
    message = str(error.value)
    assert call in message and "prefix must be a path" in message
    assert type(prefix).__name__ in message and "prefix='data/saved'" in message
    assert not td.is_memmap() and not td.is_locked


def test_load_memmap_of_none_says_what_to_pass():
    with pytest.raises(TypeError, match=r"prefix is None; pass the directory"):
        TensorDict.load_memmap(None)


@needs_tensordict
def test_tensordict_refuses_a_bytes_prefix_that_shared_td_takes(tmp_path):
    """The difference, pinned: tensordict 0.15.3 raises a TypeError about str."""
    td = tensordict.TensorDict(a=torch.zeros(3), batch_size=[3])
    with pytest.raises(TypeError, match="str"):
        td.memmap(os.fsencode(tmp_path / "x"))
    assert _td().memmap(os.fsencode(tmp_path / "y")).saved_path == tmp_path / "y"
