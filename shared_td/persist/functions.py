"""Module-level save/load functions, as ``tensordict.save`` / ``tensordict.load``."""
from __future__ import annotations

from typing import Any

from shared_td.persist import api
from shared_td.tensorclass_protocol import unwrap_tensorclass


def save(data: Any, prefix: Any = None, copy_existing: bool = False, **kwargs: Any) -> Any:
    """Save ``data`` (any tensordict or tensorclass) to ``prefix``: ``shared_td.memmap``
    (the same keywords), returning the memory-mapped copy.

    Examples:
        >>> td = shared_td.TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
        >>> _ = shared_td.save(td, "data/saved")
        >>> shared_td.load("data/saved")["obs"].shape
        torch.Size([3, 4])
    """
    return data.save(prefix, copy_existing, **kwargs)


def memmap(data: Any, prefix: Any = None, copy_existing: bool = False, **kwargs: Any) -> Any:
    """A memory-mapped copy of ``data`` (a tensordict or tensorclass) at ``prefix``, in
    anonymous shared memory if None: ``data.memmap(prefix, copy_existing, **kwargs)``,
    as ``tensordict.memmap``; ``data`` itself is unchanged.

    The keywords are those of ``TensorDict.memmap``: ``num_threads``, ``return_early``
    (a TensorDictFuture), ``share_non_tensor``, ``existsok``, ``robust_key``,
    ``atomic`` (a new directory swapped in), ``archive`` and ``compression`` (one zip
    file, e.g. a prefix ending with ``".tdz"``); see ``TensorDict.memmap_`` for each.

    Examples:
        >>> td = shared_td.TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
        >>> copy = shared_td.memmap(td, "data/mapped", num_threads=2)
        >>> copy.is_memmap(), td.is_memmap(), str(copy.saved_path).endswith("mapped")
        (True, False, True)
        >>> shared_td.memmap(td).is_memmap()  # anonymous shared memory: no file
        True
    """
    return data.memmap(prefix, copy_existing, **kwargs)


def load_memmap(
    prefix: Any, device: Any = None, non_blocking: bool = False, *, out: Any = None,
    robust_key: bool | None = True, subpath: Any = None, mode: str | None = None,
    num_threads: int = 0, allow_pickle: bool | None = None,
) -> Any:
    """Load a directory (or ``.tdz`` archive) saved by shared_td or tensordict 0.15.3,
    as the class on disk; ``shared_td.load`` is the same function, as in tensordict.

    The leaves map the files (nothing is copied). The options are those of
    ``TensorDict.load_memmap``: ``device`` (the leaves are moved there: a copy),
    ``non_blocking`` (ignored), ``out`` (a tensordict or tensorclass of ours loaded in
    place by its own class's ``load_memmap``), ``robust_key`` (the key encoding of the
    file names, as written), ``subpath`` (load only that nested key), ``mode`` (``"r"``:
    read-only, ``"r+"``: read-write), ``num_threads`` and ``allow_pickle`` (pickled
    non-tensor data is refused unless True).

    Examples:
        >>> _ = shared_td.TensorDict(obs=torch.ones(3), n={"x": torch.zeros(3)}, batch_size=[3]).save("data/run")
        >>> loaded = shared_td.load_memmap("data/run")
        >>> type(loaded).__name__, type(loaded["obs"]).__name__, loaded["obs"].tolist()
        ('TensorDict', 'MemoryMappedTensor', [1.0, 1.0, 1.0])
        >>> shared_td.load("data/run", subpath="n")["x"].tolist()
        [0.0, 0.0, 0.0]
        >>> type(shared_td.load_memmap("data/run", mode="r")["obs"]).__name__  # writes raise
        'ReadOnlyMemoryMappedTensor'
    """
    if out is not None:
        check_out_type(out)
        return type(out).load_memmap(
            prefix, device, non_blocking, out=out, robust_key=robust_key, subpath=subpath,
            mode=mode, num_threads=num_threads, allow_pickle=allow_pickle,
        )
    return api.load_memmap(
        prefix, device, non_blocking, robust_key=robust_key, subpath=subpath, mode=mode,
        num_threads=num_threads, allow_pickle=allow_pickle,
    )


load = load_memmap


def check_out_type(out: Any) -> None:
    """``load_memmap(out=)`` takes a tensordict or tensorclass of ours (a tensorclass's
    tensordict is loaded, as in tensordict 0.15.3): anything else (a dict, tensordict's
    own TensorDict) is refused before anything is read, and before
    ``type(out).load_memmap`` would be looked up on a class that lacks it or means
    something else by it. Duck-typed: persist does not import the containers."""
    if not hasattr(unwrap_tensorclass(out), "_keys_str"):
        raise TypeError(
            f"load_memmap(out=) takes a TensorDict (or tensorclass) to load into, got "
            f"{type(out).__name__}: pass a TensorDict, or use the tensordict load_memmap returns."
        )
