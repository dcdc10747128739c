"""Child processes of test_read_only_saves.py (spawn children import their target by name).

A helper module, not a test (pytest collects only test_*.py).
"""
from __future__ import annotations

import os

import torch

from shared_td import ReadOnlyError, TensorDict


def write_received(inbox, results) -> None:
    """Receive a tensordict and one of its leaves through ``inbox`` (pickled, as a queue
    pickles), try to write each, and put what happened in ``results``."""
    td, leaf = inbox.get(timeout=30)
    outcome = [type(td["a"]).__name__, type(leaf).__name__]
    for write in (lambda: td["a"].fill_(9.0), lambda: leaf.add_(1), lambda: td.zero_()):
        try:
            write()
            outcome.append(("wrote", None))
        except ReadOnlyError as error:
            outcome.append(("refused", str(error)))
    outcome.append(td["a"].tolist())
    results.put(outcome)


def drop_to_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


def load_and_write_as_nobody(path: str) -> tuple:
    """As user nobody: load ``path`` (files 0444), try a write and a memmap_() into the
    save's own files; return the messages and the leaf's values afterwards."""
    drop_to_nobody()
    loaded = TensorDict.load_memmap(path)
    messages = []
    for write in (lambda: loaded["a"].fill_(7.0), lambda: loaded.memmap_()):
        try:
            write()
            messages.append(None)
        except ReadOnlyError as error:
            messages.append(str(error))
    return (type(loaded["a"]).__name__, loaded["a"]._backing.shared, messages,
            loaded["a"].tolist(), loaded.is_memmap())


def reference_tensor() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(3, 2)


def load_with_modes_as_nobody(path: str) -> tuple:
    """As user nobody: the leaf type of a plain load of ``path`` (a file 0444), and
    what ``mode='r+'`` raises (its class name and message)."""
    drop_to_nobody()
    plain = type(TensorDict.load_memmap(path)["a"]).__name__
    try:
        TensorDict.load_memmap(path, mode="r+")
    except OSError as error:
        return plain, type(error).__name__, str(error)
    return plain, None, None
