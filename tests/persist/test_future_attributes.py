"""TensorDictFuture's ``futures`` and ``resulting_td``, side by side with tensordict 0.15.3
(``memmap_(return_early=True)`` and friends)."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.reference import needs_tensordict, tensordict
from shared_td import TensorDictFuture
from shared_td.containers.tensorclass import tensorclass
from shared_td.persist import api

WAIT = 30  # seconds: the bound on every wait for a future


def _libraries():
    libs = [pytest.param(__import__("shared_td"), id="shared_td")]
    if tensordict is not None:
        libs.append(pytest.param(tensordict, id="tensordict", marks=needs_tensordict))
    return libs


def _tree(lib):
    return lib.TensorDict(a=torch.arange(3.0), n=lib.TensorDict(b=torch.ones(3, 2), batch_size=[3]),
                          batch_size=[3])


@pytest.mark.parametrize("lib", _libraries())
def test_memmap_in_place_future_has_futures_and_the_source_as_resulting_td(lib, tmp_path):
    td = _tree(lib)
    future = td.memmap_(tmp_path, num_threads=2, return_early=True)
    assert future.resulting_td is td  # at once, before any wait
    assert isinstance(future.futures, list) and future.futures
    assert all(isinstance(each, concurrent.futures.Future) for each in future.futures)
    done, pending = concurrent.futures.wait(future.futures, timeout=WAIT)
    assert not pending
    assert future.result() is future.resulting_td is td
    assert td.is_memmap() and td["n", "b"].tolist() == [[1.0, 1.0]] * 3


@pytest.mark.parametrize("lib", _libraries())
@pytest.mark.parametrize("method", ["memmap", "memmap_like", "save"])
def test_copy_future_resulting_td_is_the_result(lib, tmp_path, method):
    td = _tree(lib)
    future = getattr(td, method)(tmp_path / method, num_threads=2, return_early=True)
    _, pending = concurrent.futures.wait(future.futures, timeout=WAIT)
    assert not pending
    copy = future.resulting_td
    assert copy is future.result() and copy is not td
    assert copy.is_memmap()
    expected = [0.0, 0.0, 0.0] if method == "memmap_like" else [0.0, 1.0, 2.0]
    assert copy["a"].tolist() == expected


def test_tensorclass_memmap_in_place_resulting_td_is_the_tensorclass(tmp_path):
    @tensorclass
    class Step:
        obs: torch.Tensor

    step = Step(obs=torch.ones(3), batch_size=[3])
    future = step.memmap_(tmp_path, num_threads=2, return_early=True)
    assert future.resulting_td is step
    assert future.result(timeout=WAIT) is step and step.is_memmap()


def test_consolidate_future_has_futures_and_resulting_td():
    td = _tree(__import__("shared_td"))
    future = td.consolidate(num_threads=2, return_early=True)
    assert isinstance(future, TensorDictFuture)
    _, pending = concurrent.futures.wait(future.futures, timeout=WAIT)
    assert not pending
    assert future.resulting_td is future.result() and future.resulting_td.is_consolidated()


def test_resulting_td_of_a_failed_copy_raises_the_write_error(tmp_path, monkeypatch):
    """A copy that failed does not exist: resulting_td raises what result() raises
    (tensordict would hand back a tree whose files were never written)."""
    def failing_write(*args, **kwargs):
        raise OSError(28, "No space left on device (test)")

    monkeypatch.setattr(api, "write_tree", failing_write)
    future = _tree(__import__("shared_td")).memmap(tmp_path, num_threads=2, return_early=True)
    concurrent.futures.wait(future.futures, timeout=WAIT)
    with pytest.raises(OSError, match="No space left"):
        future.resulting_td
    assert isinstance(future.exception(timeout=WAIT), OSError)
