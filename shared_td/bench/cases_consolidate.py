"""Benchmark cases of consolidate(): the copy into one storage, and a pickle to a child.

Each case returns ``{column: seconds}``; the first column, the floor, is the reference:
for ``consolidate`` one ``torch.cat`` of every leaf's bytes (the memcpy the copy cannot
avoid), for ``consol_pickle`` the same bytes pickled as one ``bytes`` object, sent
through the same pipe and unpickled by the same child. ``consolidate`` has a second
floor, for what its result must hold: one buffer filled with every leaf and one view of
it per leaf, in a flat dict, with raw torch (the floor of any dict-of-tensors API; the
tree's leaves are all of one dtype and shape, so this is one ``torch.stack`` and one
``unbind``, the cheapest torch has). A third reference is the floor of any consolidate():
before it copies, it must find the leaves, so ``walk + cat`` walks the same tree held as
plain nested dicts, collecting the leaves, then makes one ``torch.cat`` of them (the
tree's leaves are alike: no reshape is needed).
"""
from __future__ import annotations

import pickle

import torch

from shared_td.bench.libraries import build_tree, libraries
from shared_td.bench.timing import best_of_each
from shared_td.bench.worker import shared_worker

_WAIT = 60  # seconds: the bound on every wait for the child


def _leaf_bytes(td) -> list[torch.Tensor]:
    return [leaf.reshape(-1).view(torch.uint8) for leaf in td.values(include_nested=True, leaves_only=True)]


def _flat_leaves(td) -> dict:
    """``{nested key: leaf}`` of ``td``, checked to be of one dtype and shape."""
    flat = dict(td.items(include_nested=True, leaves_only=True))
    assert len({(leaf.dtype, leaf.shape) for leaf in flat.values()}) == 1, "a uniform tree is needed"
    return flat


def _raw_torch_views(flat: dict) -> dict:
    """One buffer holding every leaf, and a flat dict of one view of it per leaf."""
    return dict(zip(flat, torch.stack(list(flat.values())).unbind(0)))


def _dict_leaves(tree: dict, leaves: list) -> list:
    """The tensors of nested dicts, in order: the cheapest walk that finds the leaves."""
    for value in tree.values():
        if isinstance(value, dict):
            _dict_leaves(value, leaves)
        else:
            leaves.append(value)
    return leaves


def case_consolidate(options, root: str) -> dict:
    """consolidate() of the N-node tree (2 small leaves per node), vs one torch.cat and
    vs raw torch's buffer plus one view per leaf."""
    variants = {
        "memcpy floor (one cat)": (lambda: _leaf_bytes(build_tree(_shared_td(), options.nodes)), torch.cat),
        "raw torch buffer + views": (
            lambda: _flat_leaves(build_tree(_shared_td(), options.nodes)), _raw_torch_views),
        "walk + cat (nested dicts)": (
            lambda: build_tree(_shared_td(), options.nodes).to_dict(),
            lambda tree: torch.cat(_dict_leaves(tree, []))),
    }
    for name, lib in libraries().items():
        variants[name] = (lambda lib=lib: build_tree(lib, options.nodes), lambda td: td.consolidate())
        variants[f"{name} share_memory"] = (
            lambda lib=lib: build_tree(lib, options.nodes), lambda td: td.consolidate(share_memory=True))
    return best_of_each(options.repeat, variants)


def _shared_td():
    import shared_td
    return shared_td


def _child_loop(connection) -> None:  # a job of the spawn worker
    """Unpickle what arrives and answer its number of leaves, until None arrives."""
    while True:
        data = connection.recv_bytes()
        value = pickle.loads(data)
        if value is None:
            return
        count = len(value) if isinstance(value, bytes) else len(list(value.values(True, True)))
        connection.send(count)


def case_consolidated_pickle(options, root: str) -> dict:
    """Pickle a consolidated N-node tree, send it to a child (the run's spawn worker),
    which unpickles it."""
    worker = shared_worker()
    connection = worker.start_job(_child_loop)

    def send(value) -> None:
        connection.send_bytes(pickle.dumps(value))
        if not connection.poll(_WAIT):
            raise TimeoutError("the benchmark's child did not answer")
        connection.recv()

    try:
        floor = bytes(torch.cat(_leaf_bytes(build_tree(_shared_td(), options.nodes))).numpy())
        variants = {"floor (one bytes object)": (lambda: floor, send)}
        for name, lib in libraries().items():
            consolidated = build_tree(lib, options.nodes).consolidate()
            variants[name] = (lambda c=consolidated: c, send)
        send(floor)  # the child's imports are not timed
        for _, (setup, _) in list(variants.items())[1:]:
            send(setup())
        return best_of_each(options.repeat, variants)
    finally:
        connection.send_bytes(pickle.dumps(None))  # ends the job
        worker.result(_WAIT)
