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
    from tensordict import MemoryMappedTensor as TDMemoryMappedTensor
except ImportError:  # the benchmarks still run, without the tensordict column
    TDMemoryMappedTensor = None


def best_of(repeat: int, setup: Callable[[], object], run: Callable[[object], object]) -> float:
    """Best wall time of ``run(setup())`` over ``repeat`` runs (setup is not timed)."""
    times = []
    for _ in range(repeat):
        state = setup()
        start = time.perf_counter()
        run(state)
        times.append(time.perf_counter() - start)
    return min(times)


def fresh_path(root: str) -> Callable[[], str]:
    counter = iter(range(10**9))

    def make() -> str:
        path = os.path.join(root, f"leaf{next(counter)}.memmap")
        if os.path.exists(path):
            os.unlink(path)
        return path

    return make


def raw_write(data: memoryview) -> Callable[[str], None]:
    """The OS reference: os.write of the same bytes into a new file."""

    def write(path: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = data
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    return write


def case_file_leaf(args, root: str) -> dict:
    """One big leaf written to a new file (MemoryMappedTensor.from_tensor(filename=))."""
    tensor = torch.randn(args.size_mib * (1 << 20) // 4)
    data = memoryview(tensor.numpy()).cast("B")
    paths = fresh_path(root)
    out = {
        "raw os.write": best_of(args.repeat, paths, raw_write(data)),
        "shared_td": best_of(
            args.repeat, paths, lambda p: MemoryMappedTensor.from_tensor(tensor, filename=p)
        ),
    }
    if TDMemoryMappedTensor is not None:
        out["tensordict"] = best_of(
            args.repeat, paths, lambda p: TDMemoryMappedTensor.from_tensor(tensor, filename=p)
        )
    return out


def case_anonymous_leaves(args, root: str) -> dict:
    """1000 small anonymous (shared-memory) leaves."""
    tensors = [torch.randn(16) for _ in range(1000)]
    out = {
        "raw share_memory_": best_of(
            args.repeat, lambda: [t.clone() for t in tensors], lambda ts: [t.share_memory_() for t in ts]
        ),
        "shared_td": best_of(
            args.repeat, lambda: None, lambda _: [MemoryMappedTensor.from_tensor(t) for t in tensors]
        ),
    }
    if TDMemoryMappedTensor is not None:
        out["tensordict"] = best_of(
            args.repeat, lambda: None, lambda _: [TDMemoryMappedTensor.from_tensor(t) for t in tensors]
        )
    return out


def case_pickle_file_leaves(args, root: str) -> dict:
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
    if TDMemoryMappedTensor is not None:
        theirs = TDMemoryMappedTensor.from_filename(base_path, torch.float32, (1000, 16))
        their_views = list(theirs.unbind(0))
        out["tensordict"] = best_of(
            args.repeat, lambda: their_views, lambda vs: pickle.loads(pickle.dumps(vs))
        )
    return out


CASES = {
    "file_leaf": case_file_leaf,
    "anonymous_leaves": case_anonymous_leaves,
    "pickle_file_leaves": case_pickle_file_leaves,
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
        print(f"{'case':<22}{'column':<26}{'seconds':>10}{'vs reference':>14}")
        for name in args.only or CASES:
            results = CASES[name](args, root)
            reference = next(iter(results.values()))
            for column, seconds in results.items():
                print(f"{name:<22}{column:<26}{seconds:>10.4f}{reference / seconds:>13.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
