"""Benchmark cases of writing and loading: one big leaf, a tree of many small ones.

Each case takes the options and a scratch directory and returns ``{column: seconds}``
(an int is a count, not a time); the first column is the reference of the table.
"""
from __future__ import annotations

import os

import torch

from shared_td.bench.libraries import build_tree, libraries
from shared_td.bench.timing import best_of_each, fresh_dir, open_fds, raw_write


def case_big_leaf(options, root: str) -> dict:
    """memmap_ of one big leaf into a new directory vs os.write of the same bytes."""
    tensor = torch.randn(options.size_mib * (1 << 20) // 4)
    data = memoryview(tensor.numpy()).cast("B")
    dirs = fresh_dir(root)
    variants = {"raw os.write": (lambda: os.path.join(dirs(), "x"), raw_write(data))}
    for name, lib in libraries().items():
        for threads in (0, 2):
            variants[f"{name} threads={threads}"] = (
                lambda lib=lib: (lib.TensorDict(x=tensor), dirs()),
                lambda s, t=threads: s[0].memmap_(s[1], num_threads=t),
            )
    return best_of_each(options.repeat, variants)


def case_tree_to_files(options, root: str) -> dict:
    """memmap_ of N nested tensordicts x 2 small leaves into a directory."""
    dirs = fresh_dir(root)
    return best_of_each(options.repeat, {
        f"{name} threads={threads}": (
            lambda lib=lib: (build_tree(lib, options.nodes), dirs()),
            lambda s, t=threads: s[0].memmap_(s[1], num_threads=t),
        )
        for name, lib in libraries().items() for threads in (0, 2)
    })


def case_tree_load(options, root: str) -> dict:
    """load_memmap of the N-node tree written by each library."""
    variants = {}
    for name, lib in libraries().items():
        path = os.path.join(root, f"load_{name}")
        build_tree(lib, options.nodes).memmap_(path)
        variants[name] = (lambda p=path: p, lambda p, lib=lib: lib.TensorDict.load_memmap(p))
    return best_of_each(options.repeat, variants)


def case_tree_anonymous(options, root: str) -> dict:
    """memmap_() of the N-node tree into anonymous shared memory (+ fds it holds)."""
    out = best_of_each(options.repeat, {
        f"{name} threads={threads}": (
            lambda lib=lib: build_tree(lib, options.nodes),
            lambda td, t=threads: td.memmap_(num_threads=t),
        )
        for name, lib in libraries().items() for threads in (0, 2)
    })
    for name, lib in libraries().items():
        before = open_fds()
        kept = build_tree(lib, options.nodes).memmap_()
        out[f"{name} fds held"] = open_fds() - before
        del kept
    return out


def case_tree_archive(options, root: str) -> dict:
    """save of the N-node tree as one .tdz archive vs as a directory; load of the archive."""
    dirs = fresh_dir(root)
    variants = {}
    for name, lib in libraries().items():
        variants[f"{name} save dir"] = (
            lambda lib=lib: (build_tree(lib, options.nodes), dirs()), lambda s: s[0].save(s[1]))
        variants[f"{name} save archive"] = (
            lambda lib=lib: (build_tree(lib, options.nodes), dirs()),
            lambda s: s[0].save(os.path.join(s[1], "tree.tdz")))
    for name, lib in libraries().items():
        path = os.path.join(root, f"archive_{name}.tdz")
        build_tree(lib, options.nodes).save(path)
        variants[f"{name} load archive"] = (lambda p=path: p, lambda p, lib=lib: lib.TensorDict.load_memmap(p))
    return best_of_each(options.repeat, variants)
