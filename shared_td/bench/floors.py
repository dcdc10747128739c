"""The floors of the tree cases: the same work done with the raw system calls only.

A floor is what any library must do to give the same result, done by the shortest
Python over the OS and torch primitives, with none of the checks, containers or error
handling a library owes its users. It is the limit a case is measured against (its
first column), in the same run.

What each floor counts, and why:

* **mapping a file** (every floor that maps one): ``torch.from_file(path)``, which opens,
  maps and closes the file in C. It is the cheapest view of a file torch offers that
  keeps no descriptor (``mmap.mmap`` keeps a duplicate descriptor per mapping); a view
  per leaf is what any tensor API must hand out.
* **load** (:func:`load_tree`): open+read+close and ``json.loads`` of each meta.json,
  then one mapped view per leaf; the children are found in the parsed metadata.
  :func:`load_tree_checked` adds the system calls of the checks ``load_memmap`` keeps.
* **write** (:func:`write_tree`): mkdir per node, open/write/close per leaf, each
  meta.json written from ``json.dumps`` of the same dicts (no fsync: neither library
  syncs); ``map_after=True`` also maps each written file, as ``memmap_`` returns
  memory-mapped leaves (without it the floor is that of ``save``).
  :func:`write_tree_checked` adds the system calls of the checks ``memmap_`` keeps.
* **atomic rewrite** (:func:`rewrite_tree`): the write into a new sibling directory,
  ``renameat2(RENAME_EXCHANGE)`` with the old one, the old one removed.
* **append** (:func:`append_rows`): one row of zeros written (``pwrite``) past the
  declared bytes of each leaf file of a flat save, then its meta.json written anew to a
  temporary file and renamed into place (one level: no staging directory is needed).
* **anonymous** (:func:`share_anonymously`): one memfd of the total size (our layout is
  one segment per tree), ftruncate, one mapping, then one copy and one view per leaf.
* **attach** (:func:`map_views`): per leaf a mapped view of its file; anonymously, the
  one received descriptor (opened through ``/proc/<pid>/fd``) mapped once and one view
  per leaf.

Examples:
    >>> import shared_td, tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = shared_td.TensorDict(a=torch.ones(2), b={"c": torch.zeros(3)}).memmap_(d + "/t")
    ...     [tuple(v.shape) for v in load_tree(d + "/t")]
    [(2,), (3,)]
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from shared_td.platform import rename_exchange

_META = "meta.json"
_LEAF_SUFFIX = ".memmap"


def mapped_view(path: str, dtype: torch.dtype, shape) -> torch.Tensor:
    """The whole file ``path`` mapped (shared) as a ``dtype`` tensor of ``shape``."""
    count = 1
    for n in shape:
        count *= n
    return torch.from_file(path, shared=True, size=count, dtype=dtype).view(shape)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name[len("torch."):])


def load_tree(path: str) -> list[torch.Tensor]:
    """Every leaf of the save at ``path``, mapped: the floor of ``load_memmap``."""
    views: list[torch.Tensor] = []
    pending = [path]
    while pending:
        directory = pending.pop()
        fd = os.open(os.path.join(directory, _META), os.O_RDONLY | os.O_CLOEXEC)
        data = os.read(fd, 1 << 20)
        os.close(fd)
        for key, entry in json.loads(data).items():
            if type(entry) is not dict:
                continue
            if "dtype" in entry:
                views.append(mapped_view(os.path.join(directory, key + _LEAF_SUFFIX),
                                         _dtype(entry["dtype"]), entry["shape"]))
            elif "type" in entry:
                pending.append(os.path.join(directory, key))
    return views


def load_tree_checked(path: str) -> list[torch.Tensor]:
    """:func:`load_tree` with the system calls of the checks ``load_memmap`` keeps (its
    module doc): every name opened relative to its directory's descriptor with
    ``O_NOFOLLOW``; each meta.json ``lstat``-ed before it is opened (a FIFO or device is
    never opened), ``fstat``-ed after and read to its end; each leaf found with an
    ``O_PATH`` open, ``fstat``-ed, and mapped through that descriptor
    (``/proc/self/fd/<n>``: the file checked is the file mapped, and nothing else is ever
    opened). Floor minus this: the price of those guarantees; load_memmap minus this:
    its Python."""
    views: list[torch.Tensor] = []
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _load_checked(dir_fd, views)
    finally:
        os.close(dir_fd)
    return views


_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


def _load_checked(dir_fd: int, views: list) -> None:
    os.stat(_META, dir_fd=dir_fd, follow_symlinks=False)
    fd = os.open(_META, os.O_RDONLY | _FILE_FLAGS, dir_fd=dir_fd)
    size = os.fstat(fd).st_size
    data = os.read(fd, size + 1)  # a read short of the one byte more asked for ends the file
    while len(data) != size and (chunk := os.read(fd, 1 << 20)):
        data += chunk
    os.close(fd)
    for key, entry in json.loads(data).items():
        if type(entry) is not dict:
            continue
        if "dtype" in entry:
            fd = os.open(key + _LEAF_SUFFIX, _PATH_FLAGS, dir_fd=dir_fd)
            os.fstat(fd)
            views.append(mapped_view(f"/proc/self/fd/{fd}", _dtype(entry["dtype"]), entry["shape"]))
            os.close(fd)
        elif "type" in entry:
            child = os.open(key, _DIRECTORY_FLAGS, dir_fd=dir_fd)
            try:
                _load_checked(child, views)
            finally:
                os.close(child)


def saved_nodes(path: str) -> list[tuple[str, dict, list[tuple]]]:
    """The save at ``path`` as ``(relative directory, meta dict, leaves)`` per node,
    parents first, each leaf ``(file name, bytes, dtype, shape)``: what the write
    floors write (their untimed input)."""
    nodes = []
    for directory, subdirectories, names in os.walk(path):
        subdirectories.sort()
        with open(os.path.join(directory, _META), "rb") as f:
            meta = json.load(f)
        leaves = []
        for key, entry in meta.items():
            if type(entry) is dict and "dtype" in entry:
                with open(os.path.join(directory, key + _LEAF_SUFFIX), "rb") as f:
                    leaves.append((key + _LEAF_SUFFIX, f.read(), _dtype(entry["dtype"]), entry["shape"]))
        nodes.append((os.path.relpath(directory, path), meta, leaves))
    return nodes


def write_tree(nodes: list, path: str, *, map_after: bool = True) -> list[torch.Tensor]:
    """Write ``nodes`` (:func:`saved_nodes`) as a new directory ``path``: the floor of
    ``memmap_`` to files (``map_after=False``: of ``save``)."""
    views: list[torch.Tensor] = []
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    for relative, meta, leaves in nodes:
        directory = os.path.join(path, relative) if relative != "." else path
        os.mkdir(directory)
        for name, data, dtype, shape in leaves:
            leaf_path = os.path.join(directory, name)
            fd = os.open(leaf_path, flags, 0o666)
            os.write(fd, data)  # one call: Linux writes up to 2 GiB to a regular file at once
            os.close(fd)
            if map_after:
                views.append(mapped_view(leaf_path, dtype, shape))
        fd = os.open(os.path.join(directory, _META), flags, 0o666)
        os.write(fd, json.dumps(meta).encode())
        os.close(fd)
    return views


def write_tree_checked(nodes: list, path: str) -> list[torch.Tensor]:
    """:func:`write_tree` with the system calls of the checks ``memmap_`` keeps
    (persist/writer.py's doc): the new prefix opened once, every directory made and
    opened relative to its parent's descriptor (``O_NOFOLLOW``), every file created
    there with ``O_EXCL | O_NOFOLLOW``, each leaf ``fstat``-ed after its write (its
    inode: this process's one mapping of it is found again by it) and mapped through
    the descriptor it was written with (``/proc/self/fd/<n>``: the file written is
    the file mapped, whatever was renamed meanwhile). Floor minus this: the price of
    those guarantees; memmap_ minus this: its Python."""
    children: dict[str, list] = {}
    for node in nodes:
        if node[0] != ".":
            children.setdefault(os.path.dirname(node[0]) or ".", []).append(node)
    views: list[torch.Tensor] = []
    os.mkdir(path)
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _write_checked(nodes[0], dir_fd, children, views)
    finally:
        os.close(dir_fd)
    return views


def _write_checked(node: tuple, dir_fd: int, children: dict, views: list) -> None:
    relative, meta, leaves = node
    flags = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for name, data, dtype, shape in leaves:
        fd = os.open(name, os.O_RDWR | flags, 0o666, dir_fd=dir_fd)
        os.pwrite(fd, data, 0)
        os.fstat(fd)
        views.append(mapped_view(f"/proc/self/fd/{fd}", dtype, shape))
        os.close(fd)
    for child in children.get(relative, ()):
        name = os.path.basename(child[0])
        os.mkdir(name, 0o777, dir_fd=dir_fd)
        child_fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=dir_fd)
        try:
            _write_checked(child, child_fd, children, views)
        finally:
            os.close(child_fd)
    fd = os.open(_META, os.O_WRONLY | flags, 0o666, dir_fd=dir_fd)
    os.write(fd, json.dumps(meta).encode())
    os.close(fd)


def rewrite_tree(nodes: list, path: str, staging: str, *, map_after: bool = True) -> list[torch.Tensor]:
    """Write ``nodes`` into ``staging``, swap it with the existing ``path``, remove the
    old version: the floor of ``memmap_(path, atomic=True)``."""
    views = write_tree(nodes, staging, map_after=map_after)
    if not rename_exchange(staging, path):
        raise OSError(f"renameat2(RENAME_EXCHANGE) is not available for {path}")
    shutil.rmtree(staging)
    return views


def append_rows(path: str) -> None:
    """Grow the flat save at ``path`` (one level, as ``saved_nodes`` reads it) by one
    row of zeros: the floor of ``append_memmap`` of one row."""
    meta_path = os.path.join(path, _META)
    with open(meta_path, "rb") as f:
        meta = json.load(f)
    for key, entry in meta.items():
        if type(entry) is dict and "dtype" in entry:
            shape = entry["shape"]
            row = _dtype(entry["dtype"]).itemsize
            for n in shape[1:]:
                row *= n
            fd = os.open(os.path.join(path, key + _LEAF_SUFFIX), os.O_WRONLY | os.O_CLOEXEC)
            os.pwrite(fd, bytes(row), shape[0] * row)
            os.close(fd)
            shape[0] += 1
    meta["shape"][0] += 1
    with open(meta_path + ".new", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + ".new", meta_path)


def share_anonymously(sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``sources`` (contiguous CPU tensors) into one new memfd segment and return a
    view of each: the floor of an anonymous ``memmap_()``."""
    sizes = [source.numel() * source.element_size() for source in sources]
    total = sum(sizes)
    fd = os.memfd_create("floor", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        segment = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=total, dtype=torch.uint8)
    finally:
        os.close(fd)
    views, offset = [], 0
    for source, size in zip(sources, sizes):
        view = segment[offset:offset + size].view(source.dtype).view(source.shape)
        view.copy_(source)
        views.append(view)
        offset += size
    return views


def map_views(segment_path: str, layout: list[tuple[int, torch.dtype, tuple]], total: int) -> list[torch.Tensor]:
    """Map ``total`` bytes of ``segment_path`` (a ``/proc/<pid>/fd/<n>`` of a peer's
    memfd: the received descriptor) once and view each ``(byte offset, dtype, shape)``
    of ``layout``: the floor of attaching an anonymous tensordict."""
    segment = torch.from_file(segment_path, shared=True, size=total, dtype=torch.uint8)
    views = []
    for offset, dtype, shape in layout:
        count = 1
        for n in shape:
            count *= n
        views.append(segment[offset:offset + count * dtype.itemsize].view(dtype).view(shape))
    return views
