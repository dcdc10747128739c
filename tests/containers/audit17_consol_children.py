"""Child-process functions of test_audit17_consolidate.py (a helper module, not a test)."""
from __future__ import annotations

import os
import resource
import signal


def receive_and_report(inbox, answers) -> None:
    """Take one tree from ``inbox``; answer its leaves' values, whether it is
    consolidated, then write 77 into its leaf "a" (the sender looks) and answer again."""
    td = inbox.get(timeout=60)
    answers.put((td["a"].tolist(), td["b", "c"].tolist(), td.is_consolidated()))
    td["a"][0] = 77.0
    answers.put("written")


class LoadedFiles:
    """A map-style dataset whose items are ``from_consolidated(path)`` (a DataLoader
    worker sends each back through its queue)."""

    def __init__(self, path: str, count: int):
        self.path, self.count = path, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        from shared_td import from_consolidated

        td = from_consolidated(self.path)
        td["a"] += index  # the worker's own copy-on-write pages
        return td


def consolidate_limited(path: str, key_length: int, extra: int) -> None:
    """Consolidate the tree of ``path`` into ``path`` (a shared_td file, mapped), rename
    its key "a" to ``key_length`` characters, then consolidate it into ``path`` again
    with RLIMIT_FSIZE ``extra`` bytes above the file's size: a full disk, as the kernel
    sees it (EFBIG where ENOSPC would be). Exits 0 whatever that last call does."""
    import torch

    from shared_td import from_consolidated

    # a forked child must not enter the OpenMP pool the parent used (libgomp is not
    # fork-safe: its workers do not exist here, and the child would wait for them)
    torch.set_num_threads(1)

    td = from_consolidated(path).consolidate(filename=path)
    td.unlock_()
    td.rename_key_("a", "a" * key_length)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + extra, resource.RLIM_INFINITY))
    try:
        td.consolidate(filename=path)
    except Exception:  # (EFBIG, as ENOSPC: what the test looks at is the file)
        pass
    os._exit(0)


def rewrite_forever(path: str, ready) -> None:
    """Consolidate the tree of ``path`` into it again and again, its metadata growing
    and shrinking (its key renamed to ever other lengths), until killed."""
    import torch

    from shared_td import from_consolidated

    # a forked child must not enter the OpenMP pool the parent used (libgomp is not
    # fork-safe: its workers do not exist here, and the child would wait for them)
    torch.set_num_threads(1)

    td = from_consolidated(path)
    key, step = next(key for key in td.keys() if key != "n"), 0  # (renamed by a killed one)
    while True:
        step += 1
        td = td.consolidate(filename=path)  # (the same tree, or one over a new file)
        td.unlock_()
        if step == 2:
            ready.set()
        new = "a" * (1 + (step * 977) % 3000)
        td.rename_key_(key, new)
        key = new
