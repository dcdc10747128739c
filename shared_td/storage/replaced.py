"""Which file a pickled file-backed tensor names, and the error when its path holds another.

A :class:`~shared_td.storage.mapping.FileBacking` pickles by path; the receiver maps the
file again. What that path must name then depends on the mapping:

* a *shared* mapping of a file holding one leaf (a directory save's) names the path: a
  receiver maps what is there then, so an atomic rewrite of the prefix gives later
  receivers the new values, as a published prefix promises;
* a shared mapping of a file with its own layout (an archive, a consolidated file) is
  bound to its inode: the leaves lie at offsets of that very file;
* a *private* (copy-on-write) mapping (``mode="r"``, ``load_memmap(mode="r")``, a
  read-only file or archive) is bound to the inode it mapped, always: it is a copy of
  that file as loaded, and its receiver must see those bytes, not the next save's.

A receiver on the machine that pickled (same boot) that finds another file at the path
of a bound backing raises :func:`replaced_since_pickled`'s
:class:`~shared_td.errors.FileReplacedError`, never mapping the new file. (Pickling
itself does not look: a pickle may be unpickled later, or never; a plain view's sending
does, see :func:`shared_td.storage.sending.backing_to_send`.)

Example:
    >>> error = replaced_since_pickled("/data/a.memmap", shared=False)
    >>> isinstance(error, FileNotFoundError), "Load the file again" in str(error)
    (True, True)
"""
from __future__ import annotations

import errno

from shared_td.errors import FileReplacedError

__all__ = ["replaced_since_pickled"]


def replaced_since_pickled(path: str, shared: bool) -> FileReplacedError:
    """The error of a receiver that finds at ``path`` another file than the one the
    sender mapped (``shared``: whether the sender's mapping was shared, a file with its
    own layout; else it was a private copy-on-write mapping)."""
    if not shared:
        return FileReplacedError(errno.ENOENT, (
            f"The file that a copy-on-write tensor (loaded with mode=\"r\", or from a read-only "
            f"file) maps was replaced since it was loaded (a save or atomic rewrite put a new file at "
            f"{path}): mapping what is there now would read other bytes than the sender's tensor "
            "holds. Load the file again (load_memmap / from_filename) and send the new tensor, or "
            "send a copy (tensor.clone())."))
    return FileReplacedError(errno.ENOENT, (
        f"The file a pickled tensor maps was replaced since it was pickled (a save, "
        f"consolidate or atomic rewrite put a new file there): {path}. Its old bytes are "
        "no longer reachable by this path; pickle the tensor again (or load the new file)."))
