"""The docstring examples of ``shared_td``: collected, and their setting.

``python -m pytest`` runs the examples of every module of the package (``shared_td`` is
in pyproject's ``testpaths``), as ``--doctest-modules shared_td`` would, but never looks
for examples in the test folders: their helper modules are imported by the tests alone.

Each example of ``shared_td`` runs in a fresh empty directory of its own (so that it may
write relative paths like ``"data/saved"``) that holds:

* ``data/buffer``: a saved TensorDict of batch size [4] with the entries ``obs``
  (4 x 3 float32) and ``next`` (a nested TensorDict holding ``obs`` and ``reward``);
* ``data/photos``: a directory with a ``meta.json`` that is not a save (``{"name": ...}``).

and whose names are those an example reads without importing: ``torch``, ``shared_td``,
``os`` and the public classes (``TensorDict``, ``LazyStackedTensorDict``,
``NonTensorData``, ``NonTensorStack``, ``MemoryMappedTensor``, ``tensorclass``).
"""
from __future__ import annotations

import json
import os

import pytest
from _pytest.doctest import DoctestItem, DoctestModule

PACKAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_td")


def pytest_collect_file(file_path, parent):
    if parent.config.option.doctestmodules:
        return None  # pytest collects them itself
    if file_path.suffix == ".py" and file_path.name != "__main__.py" \
            and os.path.commonpath([str(file_path), PACKAGE]) == PACKAGE:
        return DoctestModule.from_parent(parent, path=file_path)
    return None


@pytest.fixture(autouse=True)
def _docstring_examples(request):
    if not isinstance(request.node, DoctestItem):
        yield  # a test of tests/: nothing to set up (not even a temporary directory)
        return
    import torch

    import shared_td

    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    buffer = shared_td.TensorDict(
        obs=torch.zeros(4, 3),
        next=shared_td.TensorDict(obs=torch.ones(4, 3), reward=torch.zeros(4, 1), batch_size=[4]),
        batch_size=[4],
    )
    buffer.memmap("data/buffer")
    os.makedirs("data/photos")
    with open("data/photos/meta.json", "w") as meta:
        json.dump({"name": "holidays"}, meta)
    namespace = request.getfixturevalue("doctest_namespace")
    namespace.update(
        torch=torch, shared_td=shared_td, os=os,
        TensorDict=shared_td.TensorDict, LazyStackedTensorDict=shared_td.LazyStackedTensorDict,
        NonTensorData=shared_td.NonTensorData, NonTensorStack=shared_td.NonTensorStack,
        MemoryMappedTensor=shared_td.MemoryMappedTensor, tensorclass=shared_td.tensorclass,
    )
    yield
