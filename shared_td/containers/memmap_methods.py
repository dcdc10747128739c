"""The memmap methods that every tensordict class and every tensorclass has.

``TensorDictBase`` and tensorclasses inherit this mixin; the work is done by the
persistence engine (``shared_td.persist.api``, ``writer.rewrite_node``), which reaches
the containers through their node kinds (containers/node_kinds.py).
"""
from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Any

import torch

from shared_td.errors import BatchSizeMismatchError, ReadOnlyError
from shared_td.keys import NestedKey, encode_key, unravel_key
from shared_td.memmap_tensor import MemoryMappedTensor, checked_shape
from shared_td.persist import api, in_flight, writer
from shared_td.persist import format as fmt
from shared_td.persist.functions import check_out_type
from shared_td.containers.load_in_place import (check_entries_fit, give_device, keep_one_value_devices, load_into,
                                                 one_value_devices)
from shared_td.containers.locking import lock_until_restored
from shared_td.containers.value_kinds import is_lazy_stack, nested_tensor_error
from shared_td.containers.unpicklable import check_picklable, naming_unpicklable
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


class MemmapMethods:
    """memmap_, memmap, memmap_like, save, load_memmap and friends."""

    def memmap_(
        self, prefix: Any = None, copy_existing: bool = False, *, num_threads: int = 0,
        return_early: bool = False, share_non_tensor: bool = False, existsok: bool = True,
        robust_key: bool | None = True, atomic: bool = False,
    ) -> Any:
        """Writes every leaf to a memory-mapped file in place, and returns self.

        Each leaf is replaced by its MemoryMappedTensor (so ``data_ptr()`` changes), the
        device becomes "cpu" and the tensordict is locked: leaves can be written in
        place (the writes reach the files), entries cannot be added or removed. After
        ``unlock_()``, ``is_memmap()`` is False.

        Args:
            prefix: the directory to write to. None writes into the tensordict's own
                directory if it is memory-mapped there already, else into anonymous
                shared memory (no file name; it lasts while some process holds it).
            copy_existing: a leaf already mapped to a file at another path is copied
                if True; if False (default) that is a RuntimeError.
            num_threads: threads writing the files; 0, 1 and a negative count (-1:
                tensordict 0.15.3 accepts it and writes in the calling thread too)
                write sequentially. Big leaves are split by byte range over the threads.
            return_early: with num_threads > 1, return a TensorDictFuture at once;
                ``future.result()`` waits and returns self (or raises the write error).
                Meanwhile self is locked, as during any memmap_ (entries added or
                removed would be lost); a failed write leaves the locks as they were.
                Errors found before any byte is written (existing files, unpicklable
                values) are raised by the call itself.
            share_non_tensor: non-tensor entries are shared between processes: an
                in-place write in one process is seen by the others.
            existsok: if False, an existing leaf file is a RuntimeError.
            robust_key: True/None percent-encodes keys in file names so every file
                stays inside prefix; False uses keys verbatim (legacy) and refuses,
                with ValueError, a key that would leave prefix.
            atomic: write into a new directory beside prefix, then swap it in (under a
                lock beside prefix), so an error or a crash leaves prefix as it was or
                as the new complete version; the old directory is replaced as a whole.
                Leaves already mapped to a file are copied (copy_existing=True needed).
                Only a save (tensordict's or shared_td's) or an empty directory is
                replaced. A symlinked prefix: the directory it points to is replaced,
                the link stays. The new version keeps the old one's mode and group.
                Not synced to disk: guards against a killed process, not a power loss.

        Raises:
            RuntimeError: a leaf has a file elsewhere and copy_existing=False; a file
                exists and existsok=False; the tensordict is in shared memory. With
                atomic=True also (an AtomicWriteError): prefix is a non-empty directory
                and existsok=False, or is not a saved tensordict (the error says why and
                what it holds).
            NotADirectoryError: atomic=True and prefix is a file.
            FileNotFoundError: atomic=True and prefix is a symlink to nothing.
            PermissionError: atomic=True and prefix's group is one this process may
                not give to the new version.
            ValueError: atomic=True and there is no directory to write to.
            NotImplementedError: return_early=True with atomic=True.
            TypeError: a non-tensor value that must be pickled (shared, or saved and
                not a JSON value) cannot be; the error names its nested key (the type
                pickle raised is kept when it is not a TypeError).
            TimeoutError: atomic=True and another writer held the prefix's lock longer
                than SHARED_TD_LOCK_TIMEOUT seconds (default 600).

        Nothing is half-done on failure: if a write fails, the files it created are
        removed, no meta.json names them, and the tensordict keeps its leaves, lock
        and flags.

        Examples:
            >>> import tempfile
            >>> td = TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
            >>> with tempfile.TemporaryDirectory() as path:
            ...     out = td.memmap_(path)
            ...     print(out is td, td.is_memmap(), td.is_locked)
            True True True
        """
        if share_non_tensor:
            # the values are shared node by node after the leaves are written: one that
            # cannot be would leave the nodes before it changed, so all are checked first
            check_picklable(self, "memmap_(share_non_tensor=True)", shared=True)
        # The tree is locked while it is written (a write that returns early runs while
        # the caller goes on; any other, while the caller's other threads do): an entry
        # added or removed meanwhile would be silently lost when the written leaves are
        # put in (tensordict's memmap_ fails on it, or locks it for return_early). A
        # successful write leaves it locked, as memmap_ always does; a failed one puts
        # the locks back as they were.
        early = return_early and not atomic and isinstance(num_threads, int) and num_threads > 1
        # an earlier return_early write of this tree (or prefix) ends first: it holds
        # the tree locked, a state this write would save and put back if it failed
        api.wait_for_background_writes(self, prefix)
        # a write returning early owns the unlock from its thread's start on: a Ctrl-C
        # landing as it returns must not unlock the tree it still writes
        handover = in_flight.Handover() if early else None
        restorers: list = []  # (filled before the tree is locked: see lock_until_restored)
        try:
            lock_until_restored(self, restorers)
            with naming_unpicklable(self, "memmap_", share_non_tensor):
                return api.memmap(
                    self, prefix, copy_existing, inplace=True, num_threads=num_threads,
                    return_early=return_early, share_non_tensor=share_non_tensor,
                    existsok=existsok, robust_key=robust_key, atomic=atomic,
                    on_early_failure=restorers[0] if early else None, handover=handover,
                )
        except BaseException:
            if restorers and (handover is None or handover.kept_by_caller()):
                restorers[0]()
            raise

    def memmap(
        self, prefix: Any = None, copy_existing: bool = False, *, num_threads: int = 0,
        return_early: bool = False, share_non_tensor: bool = False, existsok: bool = True,
        robust_key: bool | None = True, atomic: bool = False, archive: bool | None = None,
        compression: Any = None,
    ) -> Any:
        """Like ``memmap_``, but writes a new memory-mapped copy; self is unchanged.

        With ``archive=True``, or ``archive=None`` and a prefix ending with ``".tdz"``,
        ``prefix`` is one zip file holding the files of a directory save, written
        atomically (a new file beside it, renamed over it); the result is that archive
        loaded back (its leaves view the archive, read-only: ``load_memmap(prefix,
        mode="r+")`` writes into it) and locked. An archive is always a copy (as with
        ``copy_existing=True``); ``share_non_tensor`` does not apply to it.
        ``compression`` ("stored", "deflate", "bzip2", "lzma" or a ``zipfile.ZIP_*``
        constant; archives only) compresses the payloads, which are then decompressed
        into memory when loaded. See ``shared_td.persist.archive``.

        Examples:
            >>> td = TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
            >>> copy = td.memmap("data/copy")
            >>> copy.is_memmap(), td.is_memmap()
            (True, False)
            >>> td.memmap("data/copy.tdz")["obs"].shape
            torch.Size([3, 4])
        """
        with naming_unpicklable(self, "memmap", share_non_tensor):
            return api.memmap(
                self, prefix, copy_existing, inplace=False, num_threads=num_threads,
                return_early=return_early, share_non_tensor=share_non_tensor,
                existsok=existsok, robust_key=robust_key, atomic=atomic, archive=archive,
                compression=compression,
            )

    def memmap_like(
        self, prefix: Any = None, copy_existing: bool = False, *, existsok: bool = True,
        num_threads: int = 0, return_early: bool = False, share_non_tensor: bool = False,
        robust_key: bool | None = True, atomic: bool = False, archive: bool | None = None,
    ) -> Any:
        """A new memory-mapped tree with self's layout but no data copied: every leaf
        reads as zeros (an existing file is replaced by a new one, never reused).
        Without a prefix it goes to anonymous shared memory, never into self's files.
        An archive (``archive`` as in ``memmap``) is loaded back with ``mode="r+"``: writes
        into the result reach the archive file (its CRCs are not updated).

        Examples:
            >>> td = TensorDict(obs=torch.ones(3, 4), batch_size=[3])
            >>> like = td.memmap_like("data/like")
            >>> bool((like["obs"] == 0).all())
            True
        """
        with naming_unpicklable(self, "memmap_like", share_non_tensor):
            return api.memmap(
                self, prefix, copy_existing, inplace=False, like=True, num_threads=num_threads,
                return_early=return_early, share_non_tensor=share_non_tensor,
                existsok=existsok, robust_key=robust_key, atomic=atomic, archive=archive,
            )

    def save(self, prefix: Any = None, copy_existing: bool = False, **kwargs: Any) -> Any:
        """Save to ``prefix``: ``memmap(prefix, copy_existing, **kwargs)`` (the same
        keywords: ``num_threads``, ``atomic``, ``archive``...), so self is unchanged and
        the memory-mapped copy is returned (tensordict 0.15.3 too); ``dumps`` is the same.

        Example:
            >>> saved = TensorDict(obs=torch.zeros(3), batch_size=[3]).save("data/saved", atomic=True)
            >>> type(saved["obs"]).__name__, TensorDict.load_memmap("data/saved")["obs"].shape
            ('MemoryMappedTensor', torch.Size([3]))
        """
        return self.memmap(prefix, copy_existing, **kwargs)

    dumps = save

    @classmethod
    def load_memmap(
        cls, prefix: Any, device: Any = None, non_blocking: bool = False, *,
        out: Any = None, robust_key: bool | None = True, subpath: Any = None,
        mode: str | None = None, num_threads: int = 0, allow_pickle: bool | None = None,
    ) -> Any:
        """Load what ``memmap``/``save`` wrote at ``prefix``; the class is the one on disk.

        Leaves map the files (no copy); the result is unlocked. Pickled non-tensor data
        is refused unless ``allow_pickle=True``. Missing or short files, symlinks and
        unknown dtypes are errors naming the file. ``non_blocking`` is accepted for
        compatibility with tensordict, and ignored.

        - ``subpath``: a nested key of the save (``"obs"``, ``("a", "b")``); only that
          nested tensordict is loaded. It is walked key by key, never joined as a path.
        - ``mode``: ``"r"`` maps every file read-only (writes raise a ReadOnlyError
          saying so, the files stay intact), ``"r+"`` read-write (a file this process
          may not write is a PermissionError); None: read-write where allowed.
        - ``num_threads``: map the files on that many threads (0 or a negative count,
          which tensordict 0.15.3 accepts too: in this thread).
        - ``out``: an unlocked TensorDict (or tensorclass) loaded in place and returned: its entries become
          those saved (entries not on disk are dropped, as in tensordict 0.15.3), its
          nested tensordicts of the same batch size are kept and filled in place, its
          batch size stays. Checked before anything of it changes. Without ``device``,
          the leaves are loaded on out's device (as in tensordict 0.15.3); a ``device``
          other than out's is a ValueError.

        Examples:
            >>> td = TensorDict(obs=torch.zeros(3, 4), nested=TensorDict(r=torch.ones(3), batch_size=[3]),
            ...                 batch_size=[3])
            >>> _ = td.memmap("data/saved")
            >>> TensorDict.load_memmap("data/saved")["obs"].shape
            torch.Size([3, 4])
            >>> TensorDict.load_memmap("data/saved", subpath="nested", mode="r")["r"].tolist()
            [1.0, 1.0, 1.0]
        """
        if out is not None:  # (a tensorclass out: its tensordict is loaded, as in tensordict)
            _check_out(unwrap_tensorclass(out))
            device = _device_for_out(out, device)
        from shared_td.containers.tensorclass import loading_as  # (tensorclass imports this module)

        with loading_as(cls):  # (a subclass saved from __main__ is cls, as in tensordict)
            loaded = api.load_memmap(
                prefix, device, non_blocking, robust_key=robust_key, subpath=subpath, mode=mode,
                num_threads=num_threads, allow_pickle=allow_pickle,
            )
        if out is None:
            return _as_subclass(loaded, cls)
        _refuse_no_fields(out, loaded, prefix)
        _load_into(unwrap_tensorclass(out), loaded)
        return out

    @classmethod
    def load(cls, prefix: Any, *args: Any, **kwargs: Any) -> Any:
        """Same as ``load_memmap``."""
        return cls.load_memmap(prefix, *args, **kwargs)

    def load_memmap_(self, prefix: Any, robust_key: bool | None = True, *,
                     allow_pickle: bool | None = None, mode: str | None = None) -> Any:
        """Load ``prefix`` into self: self's entries become those saved there (as in
        tensordict 0.15.3, entries not on disk are dropped). ``mode`` as in
        ``load_memmap`` ("r": read-only leaves).

        As in tensordict 0.15.3, a memory-mapped self is memory-mapped again into the
        loaded directory (and locked); loaded from an archive or with ``mode="r"`` (no
        directory to write back to) it is left unlocked and no longer memory-mapped.
        Everything that can fail is done before self changes: on an error self keeps
        its entries, lock and flags."""
        loaded = api.load_memmap(prefix, robust_key=robust_key, allow_pickle=allow_pickle,
                                 mode=mode)
        if is_tensorclass(self) and is_tensorclass(loaded) and str(type(loaded)) != str(type(self)):
            # as tensordict 0.15.3 (a class redefined under the same name, as in a
            # notebook, is the same class here)
            raise ValueError(
                f"Cannot load a saved {type(loaded).__name__} in place into an instance of "
                f"{type(self).__name__} ({os.fsdecode(prefix)!r}); nothing changed: load it "
                f"with {type(loaded).__name__}.load_memmap() instead.")
        was_memmap, was_locked, was_device = self.is_memmap(), self.is_locked, self.device
        target, source = unwrap_tensorclass(self), unwrap_tensorclass(loaded)
        if is_lazy_stack(target) != is_lazy_stack(source):
            kinds = ["a lazy stack" if is_lazy_stack(node) else "a tensordict" for node in (source, target)]
            raise ValueError(
                f"Cannot load {kinds[0]} ({os.fsdecode(prefix)!r}) in place into {kinds[1]}; "
                f"nothing changed: load it with load_memmap() instead.")
        check_entries_fit(target, source, prefix)
        _refuse_no_fields(self, loaded, prefix)
        # an archive's nodes have no directory; mode="r" ones do, but read-only files
        remap = was_memmap and mode != "r" and source._memmap_prefix is not None
        if remap:
            # memory-mapped here, on the loaded tree and not on self, so that a failure
            # (a leaf mapped read-only because its file is, a full disk) leaves self as it was
            directory = api.own_directory(loaded)  # prefix as a str (it may be bytes)
            try:
                loaded.memmap_(directory)
            except ReadOnlyError as error:
                raise ReadOnlyError(
                    f"load_memmap_({directory!r}): self is memory-mapped, so it would be "
                    f"memory-mapped again into that directory, which this process may not "
                    f"write ({error}). Nothing changed: load it with mode='r' (self is then "
                    "no longer memory-mapped), or call self.unlock_() first."
                ) from error
        if was_locked:
            target._unlock_tree()  # its old nested tensordicts forget self as a locked parent
        kept_devices = one_value_devices(target) if remap else None
        load_into(target, source)  # into self's own nested nodes, where they match
        if remap:
            keep_one_value_devices(target, kept_devices)
        else:
            give_device(target, was_device)  # (loaded on the CPU: self keeps its device, throughout)
        if remap:
            target._is_memmap, target._is_shared = True, False
            if not is_lazy_stack(target):  # a stack's device is its members'
                target._device = source._device  # the CPU, as memmap_ leaves it
        if remap or (was_locked and not was_memmap):
            self.lock_()
        return self

    load_ = load_memmap_

    def memmap_refresh_(self, *, allow_pickle: bool | None = False) -> Any:
        """Re-read this memory-mapped tensordict's directory (e.g. keys another process
        added with make_memmap)."""
        path = self.saved_path if self.is_memmap() else None
        if path is None:
            raise RuntimeError(
                "Cannot refresh a TensorDict that is not memory mapped or has no path "
                "associated: call memmap_(prefix) first."
            )
        return self.load_memmap_(path, allow_pickle=allow_pickle)

    @property
    def saved_path(self) -> pathlib.Path | None:
        """The directory of a memory-mapped tensordict (None in anonymous memory).

        A tensorclass's is its tensordict's, ``<directory>/_tensordict`` (where its leaf
        files are), as in tensordict 0.15.3: ``load_memmap(step.saved_path)`` gives that
        TensorDict, ``load_memmap(step.saved_path.parent)`` the tensorclass.
        """
        if not self.is_memmap():
            raise AttributeError(
                "The tensordict has no saved path: it is not memory-mapped (call "
                "memmap_(prefix), or memmap_() again after unlock_())."
            )
        # a tensorclass's is its tensordict's, <directory>/_tensordict, as in tensordict
        # 0.15.3: its leaf files are there, and load_memmap of it gives that TensorDict
        prefix = api.own_directory(unwrap_tensorclass(self))
        return None if prefix is None else pathlib.Path(prefix)

    def make_memmap(self, key: NestedKey, shape: Any, *, dtype: torch.dtype | None = None,
                    robust_key: bool | None = True) -> torch.Tensor:
        """Add an empty (zero) memory-mapped leaf ``key`` to a memory-mapped tensordict.

        Nested keys create the missing sub-tensordicts. Returns the new tensor.
        ``robust_key`` is accepted for compatibility with tensordict, and ignored: the
        file is named with the key encoded as ``memmap_`` encodes it.
        """
        dtype = torch.get_default_dtype() if dtype is None else dtype
        return self._add_memmap_leaf(
            key, lambda path: MemoryMappedTensor.zeros(shape, dtype=dtype, filename=path, existsok=True),
            shape,
        )

    def make_memmap_from_tensor(self, key: NestedKey, tensor: torch.Tensor, *,
                                copy_data: bool = True, existsok: bool = True,
                                robust_key: bool | None = True) -> torch.Tensor:
        """Add a memory-mapped copy of ``tensor`` as leaf ``key`` (``copy_data=False``:
        same shape and dtype, zeros). ``robust_key`` is accepted and ignored, as in
        :meth:`make_memmap`."""
        if isinstance(tensor, torch.Tensor) and tensor.is_nested:
            raise nested_tensor_error(key, "make_memmap_from_tensor cannot map the entry")
        source = tensor if copy_data else torch.zeros_like(tensor, device="cpu")
        return self._add_memmap_leaf(
            key, lambda path: MemoryMappedTensor.from_tensor(
                source, filename=path, existsok=existsok, copy_existing=True
            ),
            tensor.shape,
        )

    def make_memmap_from_storage(self, key: NestedKey, storage: Any, shape: Any, *,
                                 dtype: torch.dtype | None = None,
                                 robust_key: bool | None = True) -> torch.Tensor:
        """Add leaf ``key`` viewing ``storage`` (its file must be the leaf's file).
        ``robust_key`` is accepted and ignored, as in :meth:`make_memmap`."""
        return self._add_memmap_leaf(
            key, lambda path: MemoryMappedTensor.from_storage(
                storage, shape=shape, dtype=dtype, filename=path
            ),
            shape,
        )

    def _add_memmap_leaf(self, key: NestedKey, make: Any, shape: Any = None) -> torch.Tensor:
        if is_lazy_stack(self):  # (tensordict's words; it raised AttributeError: _tensordict)
            raise RuntimeError(
                "Cannot call `make_memmap` on a LazyStackedTensorDict. Only a memory-mapped TensorDict "
                "supports it: add the entry to a member (stack.tensordicts[i].make_memmap(...)).")
        if not self.is_memmap():
            raise RuntimeError(
                "Can only make a memmap tensor within a memory-mapped tensordict: call "
                "memmap_() first."
            )
        path = unravel_key(key)
        if path in self.keys(include_nested=True):
            raise RuntimeError(
                f"The key {path} already exists within the target tensordict. Delete that "
                "entry before overwriting it."
            )
        # Walk the existing part of the path and check the shape before creating any
        # sub-tensordict or file, so that a bad key or shape leaves nothing behind.
        node, depth = unwrap_tensorclass(self), 0
        while depth < len(path) - 1 and (child := node._get_str(path[depth], None)) is not None:
            if isinstance(child, torch.Tensor) or getattr(child, "_is_non_tensor", False):
                raise KeyError(
                    f"Cannot make memmap key {path}: {path[depth]!r} holds a "
                    f"{type(child).__name__}, not a tensordict."
                )
            node, depth = unwrap_tensorclass(child), depth + 1
        batch = node.batch_size  # new sub-tensordicts get their parent's batch size
        expected = None if shape is None else checked_shape([shape] if isinstance(shape, int) else shape)
        if expected is not None and expected[: len(batch)] != batch:
            raise BatchSizeMismatchError(
                f"make_memmap of key {path}: shape {list(expected)} does not start with "
                f"the batch size {list(batch)}."
            )
        # the existing node that gains an entry: its meta.json, rewritten, must not drop
        # what another process added meanwhile (node_rewrite: locked, and checked first)
        top = node._memmap_prefix
        with writer.node_rewrite(node, top) if top is not None else contextlib.nullcontext() as rewrite_top:
            for part in path[depth:-1]:
                child = node._empty_child()
                directory = None if node._memmap_prefix is None else os.path.join(node._memmap_prefix,
                                                                                  encode_key(part))
                child.memmap_(directory) if directory else child.memmap_()
                node._tensordict[part] = child
                if directory is not None:  # an anonymous tensordict has no meta.json
                    _rewrite(node, rewrite_top, top)
                node = unwrap_tensorclass(child)
            directory = node._memmap_prefix
            filename = None if directory is None else os.path.join(directory, encode_key(path[-1]) + fmt.LEAF_SUFFIX)
            tensor = make(filename)
            if tensor.shape[: len(batch)] != batch:
                raise BatchSizeMismatchError(
                    f"make_memmap of key {path}: shape {list(tensor.shape)} does not start with "
                    f"the batch size {list(batch)}."
                )
            node._tensordict[path[-1]] = tensor
            if directory is not None:
                _rewrite(node, rewrite_top, top)
        return tensor


def _rewrite(node: Any, rewrite_top: Any, top: str) -> None:
    """Rewrite ``node``'s meta.json: through ``rewrite_top`` for the existing node the
    entry is added to (locked and checked), directly for one made just now below it."""
    if node._memmap_prefix == top:
        rewrite_top()
    else:
        writer.rewrite_node(node, node._memmap_prefix)


def _check_out(out: Any) -> None:
    """``load_memmap(out=)`` fills an unlocked TensorDict (refused before any change)."""
    check_out_type(out)
    if is_lazy_stack(out):
        raise TypeError(
            "load_memmap(out=) takes a TensorDict, got a LazyStackedTensorDict: load into "
            "a stack with out.load_memmap_(prefix), or use the stack load_memmap returns."
        )
    if out.is_locked:
        raise RuntimeError(
            "load_memmap(out=) cannot load into a locked tensordict (its entries change): "
            "call out.unlock_() first."
        )


def _device_for_out(out: Any, device: Any) -> Any:
    """The device to load into ``out`` on: ``device``, else out's (its leaves must be
    there); a ``device`` other than out's is refused before anything is read."""
    if out.device is None:
        return device
    if device is None:
        return out.device
    wanted = torch.device(device)
    same_index = wanted.index is None or out.device.index is None or wanted.index == out.device.index
    if wanted.type != out.device.type or not same_index:
        raise ValueError(
            f"Cannot load a tensordict on device {wanted} into out, a tensordict on device "
            f"{out.device}: give device={str(out.device)!r} (or none), or an out on {wanted}."
        )
    return device


def _as_subclass(loaded: Any, cls: type) -> Any:
    """A TensorDict save loaded by ``Sub.load_memmap`` (``Sub`` a TensorDict subclass) as a
    ``Sub``: shared_td saves a subclass under TensorDict's class, so its own save comes
    back as one. Anything else stays as loaded ("the class is the one on disk"): a
    tensorclass or lazy-stack subclass is never made up from a save of its base class
    (the fields the subclass adds would be missing)."""
    from shared_td.containers.tensordict import TensorDict  # (tensordict imports this module)

    if type(loaded) is not TensorDict or cls is TensorDict or not issubclass(cls, TensorDict):
        return loaded
    try:
        loaded.__class__ = cls
    except TypeError:  # slots of its own: another layout, the same attributes (an unlocked root)
        converted = cls.__new__(cls)
        converted.__dict__.update(loaded.__dict__)
        return converted
    return loaded


def _refuse_no_fields(target: Any, loaded: Any, prefix: Any) -> None:
    """A load into the tensorclass instance ``target`` (``out=``, ``load_memmap_``) of a
    save holding keys that are no fields of its class: a ValueError naming them, before
    anything changes (it held them where no attribute reads them, as ``set`` refuses to;
    tensordict 0.15.3 puts them in, then returns a TensorDict for ``out=``)."""
    if not is_tensorclass(target):
        return
    extra = sorted(set(unwrap_tensorclass(loaded)._keys_str()) - type(target)._tc_field_names)
    if extra:
        raise ValueError(
            f"Cannot load {os.fsdecode(prefix)!r} into the {type(target).__name__} given: it holds the keys {extra}, "
            f"which are no fields of {type(target).__name__}; nothing changed: load it on its own, "
            "shared_td.load_memmap(prefix), which gives the saved tree as it is.")


def _load_into(out: Any, loaded: Any) -> None:
    """Make ``out``'s entries those of ``loaded``, keeping ``out``'s nested TensorDicts
    where they have the loaded batch size. Checked first: every entry must fit out's
    batch size, else nothing of ``out`` changes."""
    source = unwrap_tensorclass(loaded)
    batch = tuple(out.batch_size)
    for key, value in source._tensordict.items():
        shape = tuple(value.shape if isinstance(value, torch.Tensor) else value.batch_size)
        if shape[: len(batch)] != batch:
            raise RuntimeError(
                f"load_memmap(out=): the saved entry {key!r} of shape {list(shape)} does not "
                f"fit out's batch size {list(batch)}: give an out of batch size "
                f"{list(loaded.batch_size)}, or none."
            )
    _fill(out, source)


def _fill(target: Any, source: Any) -> None:
    entries = {}
    for key, value in source._tensordict.items():
        mine = target._tensordict.get(key)
        if (type(mine) is type(value) and hasattr(value, "_tensordict")  # (not a non-tensor)
                and hasattr(value, "_keys_str") and not mine.is_locked
                and mine.batch_size == value.batch_size):
            _fill(mine, value)
            value = mine
        entries[key] = value
    target._tensordict = entries


