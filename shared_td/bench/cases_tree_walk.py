"""Benchmark case ``tree_walk``: listing the keys and the items of the N-node tree, as
ported code does in every loop over a tensordict (``for key, value in
td.items(True, True)``), against a walk of the same tree as plain nested dicts, which
yields the same tuple keys (the floor of any tree walk in Python); and building the
tree from those nested dicts (``TensorDict(nested, batch_size)``, what code does for
every new tensordict), per build.
"""
from __future__ import annotations

from typing import Iterator

import torch

from shared_td.bench.libraries import build_tree, libraries
from shared_td.bench.timing import best_of_each

#: Walks per timing: one walk of the 1000-node tree takes about a millisecond.
_WALKS = 20


def _dict_walk(tree: dict, prefix: tuple = ()) -> Iterator[tuple]:
    """``(key, leaf)`` of every tensor of nested dicts, keys as td.items(True, True) gives them."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _dict_walk(value, prefix + (key,))
        else:
            yield (prefix + (key,) if prefix else key), value


def _walks(listing):
    """``listing`` (a function of the tree) run _WALKS times, as one run to time."""
    def run(tree) -> None:
        for _ in range(_WALKS):
            listing(tree)
    return run


def case_tree_walk(options, root: str) -> dict:
    """``list(td.keys(True, True))`` and ``list(td.items(True, True))`` of the N-node tree
    (2 small leaves per node), per walk, vs the same walk of plain nested dicts."""
    def plain() -> dict:
        return {f"node{i}": {"obs": torch.randn(4), "reward": torch.randn(4)} for i in range(options.nodes)}

    variants = {"floor: nested dicts walk": (plain, _walks(lambda tree: list(_dict_walk(tree))))}
    for name, lib in libraries().items():
        variants[f"{name} keys"] = (lambda lib=lib: build_tree(lib, options.nodes),
                                    _walks(lambda td: list(td.keys(True, True))))
        variants[f"{name} items"] = (lambda lib=lib: build_tree(lib, options.nodes),
                                     _walks(lambda td: list(td.items(True, True))))
        variants[f"{name} build from dicts"] = (
            plain, _walks(lambda tree, lib=lib: lib.TensorDict(tree, batch_size=[4])))
    return {column: seconds / _WALKS for column, seconds in best_of_each(options.repeat, variants).items()}
