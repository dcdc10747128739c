"""Child-process functions of test_consolidate.py (a helper module, not a test)."""
from __future__ import annotations

import pickle


def add_one_and_report(td, answers) -> None:
    """Add 1 to every leaf of the (shared) consolidated ``td`` and report whether it
    arrived consolidated and which segment its leaves are in."""
    for leaf in td.values(include_nested=True, leaves_only=True):
        leaf.add_(1)
    segments = {leaf._backing.key for leaf in td.values(include_nested=True, leaves_only=True)}
    answers.put((td.is_consolidated(), sorted(segments)))


def unpickle_and_sum(connection) -> None:
    """Receive a pickled tensordict over ``connection``, answer the sum of its leaves."""
    td = pickle.loads(connection.recv_bytes())
    total = sum(float(leaf.double().sum()) for leaf in td.values(include_nested=True, leaves_only=True))
    connection.send((td.is_consolidated(), total))


def consolidate_forever(path: str, started) -> None:
    """Consolidate trees of changing sizes into ``path`` until killed (each value is
    its generation number, so a reader can tell one complete file from a mix)."""
    import torch

    from shared_td import TensorDict

    # a forked child must not enter the OpenMP pool the parent used (libgomp is not
    # fork-safe: its workers do not exist here, and the child would wait for them)
    torch.set_num_threads(1)
    generation = 0
    while True:
        generation += 1
        size = 1000 + (generation % 7) * 50_000
        td = TensorDict({"a": torch.full((size,), float(generation)),
                         "n": {"b": torch.full((3,), generation, dtype=torch.int64)}},
                        batch_size=[], names=None)
        td.consolidate(filename=path)
        started.set()


def write_rows_and_report(td, answers) -> None:
    """Fill every leaf of ``td`` (a process argument) with 7 and report whether it
    arrived consolidated."""
    for leaf in td.values(include_nested=True, leaves_only=True):
        leaf.fill_(7)
    answers.put(td.is_consolidated())
