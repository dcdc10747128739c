"""Benchmark cases of writing and loading: one big leaf, a tree of many small ones.

Each case takes the options and a scratch directory and returns ``{column: seconds}``
(an int is a count, not a time); the first column is the reference of the table: the
raw OS write, or the floor of the tree cases (:mod:`shared_td.bench.floors`), so that
a ratio of 0.67x there means 1.5x the floor.
"""
from __future__ import annotations

import os

import torch

from shared_td.bench import floors
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


def _leaves(td) -> list[torch.Tensor]:
    return list(td.values(include_nested=True, leaves_only=True))


def case_tree_to_files(options, root: str) -> dict:
    """memmap_ of N nested tensordicts x 2 small leaves into a directory, vs the floor:
    the same files written (and mapped, as memmap_ returns mapped leaves), alone and with
    the system calls of memmap_'s checks."""
    dirs = fresh_dir(root)
    reference = os.path.join(root, "to_files_reference")
    build_tree(_shared_td(), options.nodes).memmap_(reference)
    nodes = floors.saved_nodes(reference)
    variants = {
        "floor: write+map": (dirs, lambda d: floors.write_tree(nodes, d)),
        "floor: write only": (dirs, lambda d: floors.write_tree(nodes, d, map_after=False)),
    }
    variants.update({
        f"{name} threads={threads}": (
            lambda lib=lib: (build_tree(lib, options.nodes), dirs()),
            lambda s, t=threads: s[0].memmap_(s[1], num_threads=t),
        )
        for name, lib in libraries().items() for threads in (0, 2)
    })
    variants["floor + our checks"] = (dirs, lambda d: floors.write_tree_checked(nodes, d))
    return best_of_each(options.repeat, variants)


def case_tree_load(options, root: str) -> dict:
    """load_memmap of the N-node tree written by each library, vs the floor: each
    meta.json read and parsed, each leaf file mapped."""
    variants = {}
    for name, lib in libraries().items():
        path = os.path.join(root, f"load_{name}")
        build_tree(lib, options.nodes).memmap_(path)
        variants[name] = (lambda p=path: p, lambda p, lib=lib: lib.TensorDict.load_memmap(p))
    ours = os.path.join(root, "load_shared_td")
    floor = {"floor: json+open+mmap": (lambda: ours, floors.load_tree),
             "floor + our checks": (lambda: ours, floors.load_tree_checked)}
    return best_of_each(options.repeat, {**floor, **variants})


def case_tree_anonymous(options, root: str) -> dict:
    """memmap_() of the N-node tree into anonymous shared memory (+ fds it holds), vs
    the floor: one memfd, one copy and one view per leaf."""
    variants = {"floor: memfd+copy+view": (
        lambda: _leaves(build_tree(_shared_td(), options.nodes)), floors.share_anonymously)}
    variants.update({
        f"{name} threads={threads}": (
            lambda lib=lib: build_tree(lib, options.nodes),
            lambda td, t=threads: td.memmap_(num_threads=t),
        )
        for name, lib in libraries().items() for threads in (0, 2)
    })
    out = best_of_each(options.repeat, variants)
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


_APPEND_LEAVES = 100  # a flat replay save: 100 leaves of 4 floats per row


def case_tree_append(options, root: str) -> dict:
    """append_memmap of one row to a save of 100 leaves (what a replay buffer on disk
    does per step), vs the floor: the row's bytes written at the end of each leaf file
    and one meta.json written anew (to a temporary file, renamed into place). Each
    library appends to its own save, which grows by a row per run."""
    def tree(lib, rows):
        return lib.TensorDict({f"k{i}": torch.zeros(rows, 4) for i in range(_APPEND_LEAVES)}, batch_size=[rows])

    variants = {}
    floor = os.path.join(root, "append_floor")
    tree(_shared_td(), 10).memmap(floor)
    variants["floor: pwrite+meta"] = (lambda: floor, floors.append_rows)
    for name, lib in libraries().items():
        path = os.path.join(root, f"append_{name}")
        tree(lib, 10).memmap(path)
        variants[name] = (lambda lib=lib, path=path: (path, tree(lib, 1)), lambda s, lib=lib: lib.append_memmap(*s))
    return best_of_each(options.repeat, variants)


def _shared_td():
    import shared_td
    return shared_td
