"""consolidate(..., return_early=True) whose copy still runs when the program ends: the
copy completes (its file is whole), as memmap_'s background write does (persist.in_flight).

Before, the background thread submitted its copies to a thread pool after
``concurrent.futures``' exit hook had run (it refuses every submit then): the copy failed,
its file was removed, and nothing was printed.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

import shared_td

# The background copy is held back 0.3 s, so that the program always ends first.
_SCRIPT = textwrap.dedent("""
    import sys, time, torch, shared_td
    import shared_td.containers.consolidated_copy as copies
    run_copies = copies.run_copies
    def late(jobs, threads):
        time.sleep(0.3)
        return run_copies(jobs, threads)
    copies.run_copies = late
    td = shared_td.TensorDict({f"k{i}": torch.full((1 << 17,), float(i)) for i in range(4)}, [])
    td.consolidate(filename=sys.argv[1], num_threads=2, return_early=True)
""")


def test_a_background_consolidate_running_at_exit_completes(tmp_path):
    path = tmp_path / "tree.bin"
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = shared_td.TensorDict.from_consolidated(str(path))
    assert {key: float(leaf[0]) for key, leaf in loaded.items()} == {f"k{i}": float(i) for i in range(4)}
    assert all(bool((loaded[f"k{i}"] == i).all()) for i in range(4))
    assert torch.Size([1 << 17]) == loaded["k0"].shape
