"""Side-by-side benchmarks: shared_td vs tensordict 0.15.3 vs the raw OS reference.

Every case is measured in the same run, and the table shows ratios, so the noise of a
shared machine affects all three columns alike. Each number is the best of ``--repeat``
runs (the least disturbed one).

Run:  python benchmarks/run.py [--size-mib 256] [--repeat 5] [--only NAME]
"""
from __future__ import annotations

import argparse
import os
import pickle
import platform
import shutil
import tempfile
import time
from typing import Callable

import torch

from shared_td import MemoryMappedTensor

try:
    import tensordict
except ImportError:  # the benchmarks still run, without the tensordict column
    tensordict = None


def best_of(repeat: int, setup: Callable[[], object], run: Callable[[object], object]) -> float:
    """Best wall time of ``run(setup())`` over ``repeat`` runs (setup is not timed)."""
    times = []
    for _ in range(repeat):
        state = setup()
        start = time.perf_counter()
        run(state)
        times.append(time.perf_counter() - start)
    return min(times)


def fresh_dir(root: str) -> Callable[[], str]:
    """A new, not yet existing directory under ``root`` at each call."""
    counter = iter(range(10**9))
    return lambda: os.path.join(root, f"run{next(counter)}")


def raw_write(data: memoryview) -> Callable[[str], None]:
    """The OS reference: os.write of the same bytes into a new file."""

    def write(path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = data
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    return write


def _tree(lib, n: int = 1000):
    """``n`` nested tensordicts of 2 small leaves each, built with ``lib``'s TensorDict."""
    return lib.TensorDict(
        {f"node{i}": {"obs": torch.randn(4), "reward": torch.randn(4)} for i in range(n)},
        batch_size=[4],
    )


def _libraries():
    import shared_td

    libs = {"shared_td": shared_td}
    if tensordict is not None:
        libs["tensordict"] = tensordict
    return libs


def case_big_leaf(args, root: str) -> dict:
    """memmap_ of one big leaf into a new directory vs os.write of the same bytes."""
    tensor = torch.randn(args.size_mib * (1 << 20) // 4)
    data = memoryview(tensor.numpy()).cast("B")
    dirs = fresh_dir(root)
    out = {"raw os.write": best_of(args.repeat, lambda: os.path.join(dirs(), "x"), raw_write(data))}
    for name, lib in _libraries().items():
        for threads in (0, 2):
            out[f"{name} threads={threads}"] = best_of(
                args.repeat, lambda: (lib.TensorDict(x=tensor), dirs()),
                lambda s, t=threads: s[0].memmap_(s[1], num_threads=t),
            )
    return out


def case_tree_to_files(args, root: str) -> dict:
    """memmap_ of 1000 nested tensordicts x 2 small leaves into a directory."""
    dirs = fresh_dir(root)
    out = {}
    for name, lib in _libraries().items():
        for threads in (0, 2):
            out[f"{name} threads={threads}"] = best_of(
                args.repeat, lambda: (_tree(lib), dirs()),
                lambda s, t=threads: s[0].memmap_(s[1], num_threads=t),
            )
    return out


def case_tree_load(args, root: str) -> dict:
    """load_memmap of the 1000-node tree written by each library."""
    out = {}
    for name, lib in _libraries().items():
        path = os.path.join(root, f"load_{name}")
        _tree(lib).memmap_(path)
        out[name] = best_of(args.repeat, lambda: path, lambda p, lib=lib: lib.TensorDict.load_memmap(p))
    return out


def case_tree_anonymous(args, root: str) -> dict:
    """memmap_() of the 1000-node tree into anonymous shared memory (+ fds it holds)."""
    out = {}
    for name, lib in _libraries().items():
        for threads in (0, 2):
            out[f"{name} threads={threads}"] = best_of(
                args.repeat, lambda: _tree(lib), lambda td, t=threads: td.memmap_(num_threads=t)
            )
        before = _open_fds()
        kept = _tree(lib).memmap_()
        out[f"{name} fds held"] = _open_fds() - before
        del kept
    return out


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def case_leaf_pickle(args, root: str) -> dict:
    """Pickle round trip of 1000 views of one file-backed tensor (sent by reference)."""
    base_path = os.path.join(root, "pickled.memmap")
    ours = MemoryMappedTensor.from_tensor(torch.randn(1000, 16), filename=base_path, existsok=True)
    views = list(ours.unbind(0))
    out = {
        "raw pickle of the bytes": best_of(
            args.repeat, lambda: [v.clone().numpy() for v in views],
            lambda arrays: pickle.loads(pickle.dumps(arrays)),
        ),
        "shared_td": best_of(args.repeat, lambda: views, lambda vs: pickle.loads(pickle.dumps(vs))),
    }
    if tensordict is not None:
        theirs = tensordict.MemoryMappedTensor.from_filename(base_path, torch.float32, (1000, 16))
        their_views = list(theirs.unbind(0))
        out["tensordict"] = best_of(
            args.repeat, lambda: their_views, lambda vs: pickle.loads(pickle.dumps(vs))
        )
    return out


def case_atomic_rewrite(args, root: str) -> dict:
    """Rewrite of a 64 MiB tensordict (8 leaves) onto an existing save: plain vs atomic."""
    import shared_td

    td = shared_td.TensorDict({f"leaf{i}": torch.randn(2 << 20) for i in range(8)})
    path = os.path.join(root, "atomic")
    td.memmap(path)
    dirs = fresh_dir(root)
    out = {
        "memmap_ (new directory)": best_of(
            args.repeat, lambda: (td.clone(), dirs()), lambda s: s[0].memmap_(s[1])
        ),
        "memmap_ (overwrite)": best_of(args.repeat, lambda: td.clone(), lambda t: t.memmap_(path)),
        "memmap_ atomic=True": best_of(
            args.repeat, lambda: td.clone(), lambda t: t.memmap_(path, atomic=True)
        ),
    }
    from shared_td.persist import atomic

    lock = atomic.prefix_lock(path)
    rounds = 1000
    start = time.perf_counter()
    for _ in range(rounds):
        lock.acquire()
        lock.release()
    out["lock acquire+release"] = (time.perf_counter() - start) / rounds
    return out


def case_coord_attach(args, root: str) -> dict:
    """Coordinator.attach of a published 100-leaf tensordict (anonymous, then files)."""
    import shared_td

    def leaves():
        return shared_td.TensorDict({f"k{i}": torch.zeros(4) for i in range(100)})

    rounds = 200
    out = {}
    with shared_td.Coordinator() as coord:
        coord.publish("anonymous", leaves())
        coord.publish("files", leaves(), prefix=os.path.join(root, "published"))
        for name in ["anonymous", "files"]:
            coord.attach(name)  # the connection is made once per process
            out[f"{name}, 100 leaves"] = best_of(
                args.repeat, lambda: None,
                lambda _, n=name: [coord.attach(n) for _ in range(rounds)],
            ) / rounds
        out["names() round trip"] = best_of(
            args.repeat, lambda: None, lambda _: [coord.names() for _ in range(rounds)]
        ) / rounds
    return out


CASES = {
    "big_leaf": case_big_leaf,
    "tree_to_files": case_tree_to_files,
    "tree_load": case_tree_load,
    "tree_anonymous": case_tree_anonymous,
    "leaf_pickle": case_leaf_pickle,
    "atomic_rewrite": case_atomic_rewrite,
    "coord_attach": case_coord_attach,
}


def describe_machine(root: str) -> str:
    fs = "?"
    try:
        with open("/proc/mounts") as mounts:
            best = ""
            for line in mounts:
                _, mount_point, kind = line.split()[:3]
                if root.startswith(mount_point) and len(mount_point) >= len(best):
                    best, fs = mount_point, kind
    except OSError:
        pass
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, files on {fs} ({root})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256, help="size of the big leaf")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    parser.add_argument("--dir", default=None, help="where to write files (default: a temp dir)")
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="shared_td_bench_", dir=args.dir)
    try:
        print(describe_machine(root))
        print(f"{'case':<16}{'column':<26}{'seconds':>10}{'vs first row':>14}")
        for name in args.only or CASES:
            results = CASES[name](args, root)
            reference = next(iter(results.values()))
            for column, value in results.items():
                if isinstance(value, int):  # a count, not a time
                    print(f"{name:<16}{column:<26}{value:>10d}")
                else:
                    print(f"{name:<16}{column:<26}{value:>10.4f}{reference / value:>13.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
