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


def _big_tree(TensorDict, torch):
    """A tree whose metadata span several pages (200 keys): a file cut after its data
    leaves whole mapped pages past its end."""
    return TensorDict({f"key_number_{i:04d}": torch.arange(12.0).reshape(3, 4) for i in range(200)}, [])


def owner_reads_after_rewrite(path: str) -> None:
    """Consolidate a tree into ``path``, change its batch size, consolidate it into
    ``path`` again, then read the last byte of the first tree's leaf storage (the whole
    file it mapped). Exits 0 if that reads, 3 if the values are wrong (a SIGBUS: -7)."""
    import torch

    from shared_td import TensorDict

    torch.set_num_threads(1)  # (see consolidate_limited)
    c = _big_tree(TensorDict, torch).consolidate(filename=path)
    leaf = c["key_number_0000"]
    c.unlock_()
    c.batch_size = [3]
    c.consolidate(filename=path)
    storage = leaf.untyped_storage()
    storage[storage.nbytes() - 1]  # (before: past the cut file's end)
    os._exit(0 if leaf.sum().item() == 66.0 else 3)


def tensordict_maps_then_pickles(path: str, ready, go) -> None:
    """Load ``path`` with tensordict 0.15.3 (it maps the whole file), wait for ``go``
    (the parent consolidates into ``path`` again meanwhile), then pickle the tree, which
    reads its whole storage. Exits 0 if the values are right, 3 if not (SIGBUS: -7)."""
    import pickle

    import tensordict
    import torch

    torch.set_num_threads(1)  # (see consolidate_limited)
    t = tensordict.TensorDict.from_consolidated(path)
    ready.set()
    if not go.wait(timeout=30):
        os._exit(4)
    back = pickle.loads(pickle.dumps(t))
    os._exit(0 if back["key_number_0199"].sum().item() == 66.0 else 3)


def read_in_a_loop(path: str, seconds: float, answers) -> None:
    """Load ``path`` with from_consolidated again and again for ``seconds`` (the parent
    consolidates into it meanwhile); answer (loads, [the first few errors])."""
    import time

    import torch

    from shared_td import from_consolidated

    torch.set_num_threads(1)  # (see consolidate_limited)
    loads, errors, until = 0, [], time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            td = from_consolidated(path)
            assert td["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and tuple(td.batch_size) in ((), (4,))
        except Exception as error:  # (what the test looks at)
            errors.append(f"{type(error).__name__}: {error}"[:200])
        loads += 1
    answers.put((loads, errors[:3], len(errors)))
