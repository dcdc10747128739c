"""Where a write's bytes go: never outside the prefix (every name resolved relative to
an opened directory, no symlink followed, also while another process swaps directories
inside the prefix), and a failed in-place rewrite of a meta.json leaves no temporary file
(on a full tmpfs, and over a real RLIMIT_FSIZE)."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.persist.persist_helpers import TensorDict, dir_state
from tests.processes import finish, small_tmpfs

from shared_td.platform import rename_exchange

STRESS = os.environ.get("SHARED_TD_STRESS") == "1"


# ------------------------------------------------- a failed in-place rewrite (item 3)
def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=100)


_REWRITE_TOO_BIG = """
    import os, torch, shared_td
    td = shared_td.TensorDict(a=torch.ones(2), s="small", batch_size=[2]).memmap_({prefix!r})
    {limit}
    try:
        td.set_("s", "x" * {size})
    except OSError as err:
        print("error:", type(err).__name__, err)
    print("left:", sorted(os.listdir(os.path.join({prefix!r}, "s"))))
    print("disk:", shared_td.TensorDict.load_memmap({prefix!r})["s"])
"""


def _check_rewrite_failure(result: subprocess.CompletedProcess, prefix: str) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    error, left, disk = result.stdout.splitlines()
    meta = os.path.join(prefix, "s", "meta.json")
    # the error names the file and the bytes needed; the temporary is gone at once
    assert error.startswith("error: StorageFullError") and meta in error and " bytes (" in error, error
    assert left == "left: ['meta.json']", left
    assert disk == "disk: small", disk  # the old meta.json is untouched


@pytest.mark.timeout(120)
def test_a_rewrite_over_the_file_size_limit_leaves_no_temporary(tmp_path):
    prefix = str(tmp_path / "td")
    limit = textwrap.dedent("""
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))
    """).replace("\n", "\n    ")
    _check_rewrite_failure(_run(_REWRITE_TOO_BIG.format(prefix=prefix, limit=limit, size=2**21)), prefix)


@pytest.mark.timeout(120)
def test_a_rewrite_on_a_full_tmpfs_leaves_no_temporary(tmp_path):
    with small_tmpfs(tmp_path / "small") as mount_point:
        prefix = str(mount_point / "td")
        fill = textwrap.dedent(f"""
        filler = os.open({str(mount_point / "filler")!r}, os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(filler, b"f" * 4096):
                pass
        except OSError:  # ENOSPC: the tmpfs is full
            os.close(filler)
        """).replace("\n", "\n    ")
        result = _run(_REWRITE_TOO_BIG.format(prefix=prefix, limit=fill, size=2**16))
    _check_rewrite_failure(result, prefix)


# ------------------------------------------------ writes never escape the prefix (item 5)
def _nested() -> TensorDict:
    return TensorDict(
        {"a": {"b": {"x": torch.ones(4), "y": torch.zeros(4)}, "c": torch.ones(4), "s": "text"},
         "d": torch.ones(4)},
        [4],
    )


def _swap_in_symlinks(prefix: str, canary: str, stop, seconds: float) -> None:
    """Until ``stop`` (at most ``seconds``): swap prefix/a and prefix/a/b with symlinks
    to directories of ``canary`` (RENAME_EXCHANGE, so a path never goes missing), and
    replace them by plain renames too."""
    deadline = time.monotonic() + seconds
    pairs = []
    for inside, outside in (("a", canary), (os.path.join("a", "b"), os.path.join(canary, "b"))):
        link = os.path.join(prefix, inside + "-link")
        os.symlink(outside, link)
        pairs.append((os.path.join(prefix, inside), link))
    turn = 0
    while not stop.is_set() and time.monotonic() < deadline:
        turn += 1
        for real, link in pairs:
            try:
                if turn % 3:
                    rename_exchange(real, link)  # the symlink takes the directory's place
                    rename_exchange(real, link)  # and gives it back
                else:  # a rename away and a symlink in the freed name
                    os.rename(real, real + "-away")
                    os.symlink(os.readlink(link), real)
                    os.unlink(real)
                    os.rename(real + "-away", real)
            except OSError:
                pass  # a directory the writer just removed or has not made yet


@pytest.mark.timeout(120)
@pytest.mark.parametrize("inplace", [True, False])
def test_no_write_escapes_the_prefix_while_its_directories_are_swapped(tmp_path, inplace):
    prefix, canary = str(tmp_path / "p"), str(tmp_path / "canary")
    os.makedirs(os.path.join(canary, "b"))
    _nested().memmap(prefix)  # the directories the attacker swaps exist from the start
    stop = multiprocessing.get_context("fork").Event()
    attacker = multiprocessing.get_context("fork").Process(
        target=_swap_in_symlinks, args=(prefix, canary, stop, 60.0), daemon=True
    )
    attacker.start()
    writes, refused = 0, 0
    try:
        deadline = time.monotonic() + (20.0 if STRESS else 2.5)
        while time.monotonic() < deadline:
            td = _nested()
            try:
                td.memmap_(prefix) if inplace else td.memmap(prefix)
                writes += 1
            except (RuntimeError, OSError):
                refused += 1  # refusing is allowed; writing outside is not
    finally:
        stop.set()
        assert finish(attacker) == 0
    assert dir_state(canary) == {"b": "<dir>"}, "a write escaped the prefix"
    assert writes + refused > 20, (writes, refused)


def test_a_symlink_planted_at_a_nested_directory_is_refused(tmp_path):
    prefix, outside = tmp_path / "p", tmp_path / "outside"
    _nested().memmap(prefix)
    outside.mkdir()
    (outside / "b").mkdir()
    os.rename(prefix / "a", tmp_path / "a-away")
    os.symlink(outside, prefix / "a")
    for call in ("memmap_", "memmap", "memmap_like"):
        with pytest.raises(RuntimeError, match="symlink"):
            getattr(_nested(), call)(prefix)
    assert dir_state(outside) == {"b": "<dir>"}
