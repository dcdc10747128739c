"""Loading a saved directory: read meta.json, map leaf files, let each node's kind rebuild it.

Every file is opened relative to the directory opened first (``dir_fd``), so a load
that races an atomic rewrite (a swap of the whole directory) reads one version only; if
that version is deleted under it, the load starts again on the new one.  Unlike
tensordict, a missing or short leaf file is an error naming the key (never a silently
dropped key or a SIGBUS), symlinked leaf files and child directories are refused, and
pickled non-tensor data is only read with ``allow_pickle=True`` (refused before
unpickling).

Untrusted directories: each meta.json is checked by ``node_meta.NodeMeta.from_json`` before
anything is mapped (a bad field is a :class:`~shared_td.errors.FormatError` naming the
file and the field; ``shared-td verify`` reports the same errors through
:func:`read_meta`). Only regular files are read or mapped: a FIFO, socket, device
or directory in the place of a file is refused, and so is a meta.json of more than
``bounded_reads.MAX_META_BYTES`` (a pickle: ``MAX_PICKLE_BYTES``), before it is read:
a sparse file may announce any size at no cost on disk. A meta.json (or pickle) is
checked with ``lstat`` before it is opened, then opened ``O_NONBLOCK`` and checked again with
``fstat``, so a swap between the two cannot make a load block. A leaf file is found
with an ``O_PATH`` open and checked with its ``fstat``; only its mapping opens it, through
that descriptor, so whatever is put in its place and whenever, nothing but the regular
file that was checked is opened (no device's open, no FIFO's waiting writer let through).

Read-only saves (read-only files, a read-only file system, immutable files: ``open``
fails with EACCES, EPERM or EROFS) load, as in tensordict 0.15.3: each such leaf is
mapped privately, copy-on-write (``MAP_PRIVATE``), and is a
:class:`~shared_td.memmap_tensor.ReadOnlyMemoryMappedTensor`, which refuses writes with a
:class:`~shared_td.errors.ReadOnlyError` naming the file and why (*ours*: tensordict lets
the write change this process's copy only, so it is lost without a word). It is not a
``PROT_READ`` mapping on purpose: torch cannot mark a tensor read-only, so a write that
slipped through (a numpy view, a raw storage) would kill the process with SIGSEGV
instead of raising.

Options (``load_memmap``'s): ``mode="r"`` opens every leaf read-only and gives those same
read-only leaves, their errors saying "opened with mode='r'"; ``mode="r+"`` insists on
writable files (a file this process may not write is a PermissionError naming it);
``mode=None`` maps writable what it may and read-only the rest. ``subpath`` loads one
nested tensordict of the save, reached key by key through the same ``dir_fd`` walk (a key
listed in each meta.json, by its file name), so it cannot leave the prefix.
``num_threads`` maps the leaf files on a thread pool; every thread is joined before the
load returns or raises.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import pickle
import stat
import sys
import time
from concurrent.futures import wait
from typing import Any

import torch

from shared_td.errors import FormatError, NotASaveError
from shared_td.keys import unravel_key
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.archive import ZIP_STARTS, Archive, ArchiveNode
from shared_td.persist.bounded_reads import MAX_META_BYTES, MAX_PICKLE_BYTES
from shared_td.persist.node_meta import ChildMeta, LeafMeta, NodeMeta
from shared_td.storage import files
from shared_td.storage.fd_mapping import descriptor_limits
from shared_td.storage.files import Directory, FileTooShortError
from shared_td.storage.mapping import READ_ONLY_ERRNOS
from shared_td.thread_pool import ThreadPool

#: The values of ``load_memmap(mode=)``: None (writable where allowed), read-only, read-write.
MODES = (None, "r", "r+")
MODE_R_REASON = "opened with mode='r'"
#: Why a non-tensor value of an archive loaded with mode="r+" is read-only all the same.
ARCHIVE_VALUE_REASON = ("it was loaded from an archive, where a non-tensor value lives in a "
                        "meta.json or pickle member that is never rewritten in place (mode='r+' "
                        "writes into its tensors only)")

#: How long a load keeps restarting while atomic writers replace the directory under it.
RETRY_SECONDS = 60.0
#: Times one node is read again when a node rewrite removed a side file its meta.json
#: named while it was loaded (each rewrite takes milliseconds).
NODE_REREADS = 100


def check_allow_pickle(allow_pickle: Any) -> bool:
    """``allow_pickle`` must be True, False or None (None means False)."""
    if allow_pickle is None:
        return False
    if type(allow_pickle) is not bool:
        raise TypeError(
            f"allow_pickle must be True, False or None, got {allow_pickle!r} of type "
            f"{type(allow_pickle).__name__}."
        )
    return allow_pickle


def check_mode(mode: Any) -> str | None:
    """``mode`` must be one of :data:`MODES` (ValueError otherwise)."""
    if not (mode is None or (type(mode) is str and mode in MODES)):
        raise ValueError(f"mode must be 'r', 'r+' or None, got {mode!r}.")
    return mode


def check_num_threads(num_threads: Any) -> int:
    """``num_threads`` is a count of threads, 0 for none; a negative count is 0, as
    tensordict 0.15.3 accepts -1 and uses no thread for it (TypeError if not an int)."""
    if type(num_threads) is not int:
        raise TypeError(f"num_threads must be an int, got {num_threads!r} of type {type(num_threads).__name__}.")
    return max(num_threads, 0)


#: A load keeps the checked metadata of this many distinct meta.json files of a
#: TensorDict node, up to this many bytes each, to reuse for the same bytes elsewhere.
PARSED_KEPT = 64
PARSED_MAX_BYTES = 1 << 14


def read_meta(directory: Directory, parsed: dict | None = None) -> NodeMeta:
    """The meta.json of ``directory``, parsed and checked (FormatError naming file and field).

    ``parsed`` (bytes -> NodeMeta, kept by one load): the nodes of a tree are often alike
    (every step of a trajectory, every agent), and the same bytes check the same way, so a
    meta.json whose bytes were checked before is neither parsed nor checked again. Only
    TensorDict nodes are kept: their parsed document is handed to no one (a NonTensorData's
    value, a tensorclass's fields are, and must not be shared between nodes).
    """
    where = directory.join(fmt.META)
    try:
        data = directory.read(fmt.META, limit=MAX_META_BYTES)  # (bigger: refused unread)
    except FileNotFoundError:
        raise FileNotFoundError(f"No saved tensordict at {directory.path!r}: {fmt.META} is missing.") from None
    if parsed is not None:
        known = parsed.get(data)
        if known is not None:
            return known.read_at(where)
    try:
        # json.loads(bytes) would make the same str copy itself (its scanner reads str),
        # and would also take UTF-16 and UTF-32: decoding here keeps meta.json UTF-8
        document = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise FormatError(where, f"not valid JSON: {error}") from None
    meta = NodeMeta.from_json(document, where=where)
    if parsed is not None and meta.type == fmt.TENSORDICT_TYPE and len(data) <= PARSED_MAX_BYTES \
            and len(parsed) < PARSED_KEPT:
        parsed[data] = meta
    return meta


class Loader:
    """Loads one saved tree; ``robust_key`` picks the file names tried first, ``mode``
    how leaves are opened and ``num_threads`` how many threads map them (module doc)."""

    def __init__(self, *, robust_key: bool = True, allow_pickle: bool = False,
                 mode: str | None = None, num_threads: int = 0, map_leaves: bool = True):
        self.robust_key = True if robust_key is None else robust_key
        # False: each leaf an empty tensor on the "meta" device of its saved dtype and
        # shape, no file opened (a caller that reads only the tree's structure and values)
        self.map_leaves = map_leaves
        self.allow_pickle = check_allow_pickle(allow_pickle)
        # member name -> pickle bytes made by this process (load_written_archive): read
        # from here, never from the file; None: side files are read (if allow_pickle)
        self.pickles: dict[str, bytes] | None = None
        self.mode = check_mode(mode)
        self.num_threads = check_num_threads(num_threads)
        self._opened: tuple | None = None  # (root directory, its path) of the current load
        self._pool: ThreadPool | None = None
        self._names: dict[tuple[str, bool], list[str]] = {}  # (key, leaf) -> its file names
        self._parsed: dict[bytes, NodeMeta] = {}  # meta.json bytes -> checked (read_meta)

    def load(self, directory: str, subpath: Any = None) -> Any:
        """Load the tree at ``directory`` (or its nested tensordict ``subpath``, a nested
        key), restarting if an atomic writer replaced it."""
        path = os.path.abspath(os.fspath(directory))
        parts = () if subpath is None else unravel_key(subpath)
        deadline = time.monotonic() + RETRY_SECONDS
        while True:
            root = self._open_root(path)
            self._opened = (root, path)
            opened = [root]
            try:
                node, parent_batch = self._walk(opened, parts, subpath)
                if not self.num_threads:
                    return self._load(node, parent_batch)
                self._pool = ThreadPool.start(self.num_threads, "shared_td-load")  # (None: no thread started)
                try:
                    return self._load(node, parent_batch)
                finally:
                    if self._pool is not None:
                        self._pool.shutdown()
            except RecursionError:
                raise too_deep(path) from None
            except (FileNotFoundError, FormatError, FileTooShortError):
                if not _replaced(root, path) or time.monotonic() > deadline:
                    raise
            finally:
                self._pool = None
                for each in reversed(opened):
                    each.close()

    def load_opened(self, root: ArchiveNode) -> Any:
        """Load the whole tree of the archive ``root`` opened by the caller (who knows it
        is the file meant: no path is opened, no retry); closes it."""
        try:
            return self._load(root, None)
        except RecursionError:
            raise too_deep(root.path) from None
        finally:
            root.close()

    def _walk(self, opened: list, parts: tuple, subpath: Any) -> tuple[Directory, tuple | None]:
        """Open the directory of the nested key ``parts`` below ``opened[0]``, key by key:
        each part must be a nested tensordict listed in its parent's meta.json, found by
        its file name (never a path join, so '..' or '/' cannot leave the save), or the
        index of a member of a lazy stack.
        Returns it and its parent's batch size; ``opened`` collects what to close."""
        parent_batch = None
        for depth, part in enumerate(parts):
            directory = opened[-1]
            meta = read_meta(directory)
            if meta.type == fmt.LAZY_STACK_TYPE and part in nodes.kind_for_type_string(
                    meta.type).child_names(meta, directory.exists):
                # a member of a lazy stack, by its index ("1"), as tensordict 0.15.3 walks
                opened.append(directory.child(part))
                parent_batch = None  # a stack records no batch size of its own
                continue
            entry = next((e for e in meta.entries if e.key == part), None)
            where = f"subpath {subpath!r}: {directory.path}/{fmt.META}"
            if entry is None:
                hint = ""
                if depth == 0 and isinstance(subpath, str) and "/" in subpath:
                    hint = f" (to walk into nested keys, give a tuple: {tuple(subpath.split('/'))!r})"
                raise ValueError(f"No tensordict found under {where} lists no key {part!r}{hint}.")
            if not isinstance(entry, ChildMeta):
                raise ValueError(f"No tensordict found under {where} says key {part!r} is a tensor, "
                                 "not a nested tensordict: load its parent and index it.")
            opened.append(self._open_child(directory, part))
            parent_batch = meta.batch_size
        return opened[-1], parent_batch

    def _open_root(self, path: str) -> Directory | ArchiveNode:
        """The save at ``path``: a directory or an archive, decided by what one open gave
        (its fstat), never by a check before it: a writer renaming an archive in between
        must not make a valid archive look like "a file" (nor a directory a file)."""
        for _ in range(1000):  # the two-renames fallback leaves the path missing briefly
            try:
                # O_NONBLOCK, O_NOCTTY: a FIFO or a terminal in the place is opened without
                # waiting for a writer or becoming this process's terminal, then refused
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            except FileNotFoundError:
                if not os.path.lexists(fmt.lock_path(path)):
                    break
                time.sleep(0.001)
                continue
            try:
                info = os.fstat(fd)
                if stat.S_ISDIR(info.st_mode):
                    root, fd = Directory(fd, path, "load"), None
                    return root
                archive = self._open_archive(path, fd, info)
            finally:
                if fd is not None:
                    os.close(fd)
            if archive is not None:
                return archive
            # the file was replaced between the two opens: look again
        raise FileNotFoundError(f"No saved tensordict at {path}: no such directory.")

    def _open_archive(self, path: str, fd: int, info: os.stat_result) -> ArchiveNode | None:
        """The archive ``fd`` opened (``info``: its fstat), or None if ``path`` names
        another file by the time the archive opens it by name."""
        kind = files.file_kind(info.st_mode)
        if kind is not None:  # a FIFO, socket or device: never read, so never waited on
            raise NotASaveError(f"{path} is {kind}, not a saved tensordict directory nor "
                                     "an archive (a zip file).")
        if os.pread(fd, 4, 0) not in ZIP_STARTS:  # (read from the descriptor already open)
            raise NotASaveError(f"{path} is a file, not a saved tensordict directory nor "
                                     "an archive (a zip file).")
        reason = MODE_R_REASON if self.mode == "r" else None
        try:
            archive = Archive(path, writable=self.mode == "r+", read_only_reason=reason)
        except FileNotFoundError:
            return None  # renamed away meanwhile
        except OSError as error:
            if self.mode != "r+" or error.errno not in READ_ONLY_ERRNOS:
                raise
            raise PermissionError(
                error.errno, f"Cannot load the archive {path} with mode='r+': "
                f"{READ_ONLY_ERRNOS[error.errno]}. Load it with mode='r' (or None) to map "
                "it read-only, or make it writable.") from None
        opened = os.fstat(archive.fd)
        if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
            archive.close()
            return None
        return ArchiveNode(archive)

    def _load(self, directory: Directory, parent_batch: tuple | None) -> Any:
        """Load one node: its keyed entries (from its meta.json), its fixed-name
        children (the kind names them), then the kind rebuilds the container.

        A node rewrite in another process (a non-tensor ``set_``) renames a new meta.json
        in, then removes the side file (other.pickle, pickle.pkl) the new value no longer
        needs: a side file that the meta.json read here names and that is gone when read
        makes the node read again, from its new meta.json (comparing the two meta.json
        cannot tell: a later rewrite may put the same one back). One still missing after
        :data:`NODE_REREADS` reads is damage: raised. (A loop in this frame: a node nested
        near the recursion limit is read again at the depth it was read, and a level of
        the tree costs one frame.)"""
        for attempt in range(NODE_REREADS + 1):  # (the last one raises)
            meta = read_meta(directory, self._parsed)
            kind = nodes.kind_for_type_string(meta.type)
            values = dict.fromkeys(entry.key for entry in meta.entries)  # in the saved order
            mapping = {}  # key -> future of its leaf, when a pool maps them
            try:
                for entry in meta.entries:
                    if isinstance(entry, ChildMeta):
                        child = self._open_child(directory, entry.key)
                        try:
                            values[entry.key] = self._load(child, meta.batch_size)
                        finally:
                            child.close()
                    elif self._pool is not None:
                        mapping[entry.key] = self._pool.submit(self._load_leaf, directory, entry)
                    else:
                        values[entry.key] = self._load_leaf(directory, entry)
            except BaseException:
                for future in mapping.values():  # (the leaves not started never run)
                    future.cancel()
                raise
            finally:
                if mapping:  # the threads use directory's fd: none may outlive it, also on an error
                    _wait_all(list(mapping.values()))
            for key, future in mapping.items():
                values[key] = future.result()
            names = kind.child_names(meta, directory.exists)
            for name in names:
                values[name] = self._load_child(directory, name, meta.batch_size)
            # children found by looking at the directory: if the tree was swapped out
            # meanwhile, the first missing one may have gone with the old version (all of
            # them: a lazy stack without members is a save too)
            if (names or meta.type == fmt.LAZY_STACK_TYPE) and self._opened is not None and _replaced(*self._opened):
                raise FileNotFoundError(f"{directory.path} was replaced while it was loaded.")
            # a node of an archive has no directory of its own to write back to
            own = None if isinstance(directory, ArchiveNode) else directory.path
            gone: list[str] = []  # the side files found missing (their read, not their unpickling)
            unpickle = functools.partial(self._unpickle, directory, gone=gone)
            try:
                return kind.rebuild(meta, values, directory=own, parent_batch=parent_batch, unpickle=unpickle,
                                    read_only=self._read_only_reason(directory))
            except FileNotFoundError:
                if not gone or own is None or attempt >= NODE_REREADS:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _read_only_reason(self, directory: Directory) -> str | None:
        """Why a node loaded from ``directory`` may not be written in place (its files,
        or its archive, are not written back: a write would change this process's copy
        only), as its tensors say it; None when writable."""
        if isinstance(directory, ArchiveNode):
            # whatever the mode: mode="r+" writes tensors into the file, but a non-tensor
            # value lives in a meta.json or pickle member, never rewritten in place
            archive = directory.archive
            return ARCHIVE_VALUE_REASON if archive.writable else archive.read_only_reason
        return MODE_R_REASON if self.mode == "r" else None

    def _load_child(self, directory: Directory, name: str, batch_size=None) -> Any:
        child = directory.child(name)
        try:
            return self._load(child, batch_size)
        finally:
            child.close()

    def _load_leaf(self, directory: Directory, leaf: LeafMeta) -> torch.Tensor:
        if leaf.is_nested:
            raise NotImplementedError(f"{self._where(directory, leaf.key)}: nested tensors cannot be loaded yet.")
        if not self.map_leaves:
            return torch.empty(leaf.shape, dtype=leaf.dtype, device="meta")
        if 0 in leaf.shape:  # zero-element leaves have no file
            return MemoryMappedTensor.empty(torch.Size(leaf.shape), dtype=leaf.dtype)
        if isinstance(directory, ArchiveNode):
            return directory.leaf(self._resolve(directory, leaf.key, leaf=True), leaf)
        return MemoryMappedTensor._from_backing(self._map_leaf(directory, leaf.key), 0, leaf.dtype, leaf.shape)

    # ------------------------------------------------------------------ files
    def _candidates(self, key: str, *, leaf: bool) -> list[str]:
        """File names of ``key``: its robust name, then its legacy (raw) name if safe
        (worked out once per key and load: the same keys recur in every node)."""
        names = self._names.get((key, leaf))
        if names is None:
            names = self._names[key, leaf] = fmt.file_names(key, leaf=leaf, robust_key=self.robust_key)
        return names

    def _map_leaf(self, directory: Directory, key: str) -> files.FileBacking:
        """Map the file of leaf ``key``, found with ``O_PATH`` (so that nothing but a
        regular file is ever opened: :meth:`Directory.open_path_regular`) and opened
        only by its mapping.

        A file this process may not write (its mode, a read-only file system, an
        immutable file), or any file with ``mode="r"``, is mapped copy-on-write, its
        tensors refusing writes and saying why. With ``mode="r+"`` such a file is an error.
        """
        names = self._candidates(key, leaf=True)
        for name in names:
            try:
                fd, st = directory.open_path_regular(name)
            except FileNotFoundError:
                continue
            try:
                return self._map(f"{directory.path}/{name}", fd, st)
            finally:
                os.close(fd)
        raise self._missing(directory, key, names, "file")

    def _map(self, path: str, fd: int, st: os.stat_result) -> files.FileBacking:
        if self.mode == "r":
            return files.map_path_fd(path, fd, st, read_only=MODE_R_REASON)
        try:
            return files.map_path_fd(path, fd, st)
        except OSError as error:
            if error.errno not in READ_ONLY_ERRNOS:
                raise
            if self.mode == "r+":
                raise PermissionError(
                    error.errno, f"Cannot load {path} with mode='r+': "
                    f"{READ_ONLY_ERRNOS[error.errno]}. Load it with mode='r' (or None) "
                    "to map it read-only, or make it writable."
                ) from None
            return files.map_path_fd(path, fd, st, read_only=READ_ONLY_ERRNOS[error.errno])

    def _open_child(self, directory: Directory, key: str) -> Directory:
        """Open the sub-directory of nested key ``key`` (see ``_candidates``): each name
        is opened directly (``O_NOFOLLOW``), a missing one tried next, with no ``lstat``
        before."""
        names = self._candidates(key, leaf=False)
        for name in names:
            try:
                return directory.child(name)
            except FileNotFoundError:
                continue
        raise self._missing(directory, key, names, "directory")

    def _resolve(self, directory: ArchiveNode, key: str, *, leaf: bool) -> str:
        """The existing member name of ``key`` in an archive (see ``_candidates``)."""
        names = self._candidates(key, leaf=leaf)
        for name in names:
            if directory.exists(name):
                return name
        raise self._missing(directory, key, names, "file" if leaf else "directory")

    def _missing(self, directory: Directory, key: str, names: list, kind: str) -> FileNotFoundError:
        return FileNotFoundError(
            f"The {kind} of {self._where(directory, key)} is missing (looked for {names}): "
            "the save is incomplete or was moved."
        )

    @staticmethod
    def _where(directory: Directory, key: str) -> str:
        return f"key {key!r} listed in {directory.path}/{fmt.META}"

    def _unpickle(self, directory: Directory, name: str, gone: list | None = None) -> Any:
        """The value pickled in the side file ``name`` of ``directory``; a side file that is
        missing is added to ``gone`` (a FileNotFoundError that its unpickling raises, the
        pickled object's own, is not: it is raised as it is)."""
        if self.pickles is not None and isinstance(directory, ArchiveNode):
            own = self.pickles.get(directory._member(name))
            if own is not None:  # bytes this process pickled from its own objects
                return pickle.loads(own)
        path = os.path.join(directory.path, name)
        if not self.allow_pickle:
            raise RuntimeError(
                f"Refusing to load pickled non-tensor data from {path}: unpickling can run "
                "arbitrary code. Pass allow_pickle=True if you trust this directory."
            )
        try:
            data = directory.read(name, limit=MAX_PICKLE_BYTES)
        except FileNotFoundError:
            if gone is not None:
                gone.append(name)
            raise
        return pickle.loads(data)


def _wait_all(futures: list) -> None:
    """Wait for every one of ``futures`` (jobs of the load's pool using a directory's
    descriptor, closed once this returns). A Ctrl-C meanwhile cancels the jobs not
    started and is raised once the running ones have ended."""
    interrupted = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as error:  # noqa: B036 - a Ctrl-C: raised below, once none runs
            interrupted = interrupted or error
            for future in futures:
                future.cancel()
    if interrupted is not None:
        raise interrupted


def too_deep(path: str) -> FormatError:
    """The error of a save nested deeper than a load can follow (each level of nesting
    is a level of recursion: a hostile save may have thousands)."""
    return FormatError(path, f"nested too deep to load: more levels than Python's recursion limit "
                       f"({sys.getrecursionlimit()}) lets a load follow (shared_td and tensordict "
                       "write ~500 at most under the default limit): a damaged or hostile save, or "
                       "one written under a raised limit (sys.setrecursionlimit) that this load "
                       "needs too")


def load_written_archive(path: str, fd: int, *, writable: bool, pickles: dict[str, bytes]) -> Any:
    """The archive a writer just wrote to the file open as ``fd`` (read-write), loaded
    through a duplicate of ``fd``, never by ``path``: a rename over ``path`` by any other
    process since the write cannot give the caller that file's data, or run its
    pickles. ``path`` names the archive in messages and mapped tensors; ``writable``
    maps it shared (``mode="r+"``); ``pickles`` are the side files the writer made
    (member name -> bytes), unpickled instead of the archive's (no other is read)."""
    try:
        dup = os.dup(fd)
    except OSError as err:
        if err.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise OSError(err.errno, f"Cannot open the archive {path} again to load it: {err.strerror}. "
                                 f"{descriptor_limits(err.errno)}") from None
    archive = Archive(path, writable=writable, fd=dup)
    loader = Loader(mode="r+" if writable else None)
    loader.pickles = pickles
    return loader.load_opened(ArchiveNode(archive))


def _replaced(root: Directory, path: str) -> bool:
    """True if ``path`` no longer names the directory ``root`` opened (a swap happened)."""
    try:
        current = os.stat(path)
    except FileNotFoundError:
        return True
    opened = os.fstat(root.fd)
    return (current.st_dev, current.st_ino) != (opened.st_dev, opened.st_ino)
