"""Module-level save/load functions, as ``tensordict.save`` / ``tensordict.load``."""
from __future__ import annotations

from typing import Any

from shared_td.persist import api
from shared_td.tensorclass_protocol import unwrap_tensorclass


def save(data: Any, prefix: Any = None, copy_existing: bool = False, **kwargs: Any) -> Any:
    """Save ``data`` (any tensordict or tensorclass) to ``prefix``; see ``memmap``.

    Examples:
        >>> td = shared_td.TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
        >>> _ = shared_td.save(td, "data/saved")
        >>> shared_td.load("data/saved")["obs"].shape
        torch.Size([3, 4])
    """
    return data.save(prefix, copy_existing, **kwargs)


def memmap(data: Any, prefix: Any = None, copy_existing: bool = False, **kwargs: Any) -> Any:
    """A memory-mapped copy of ``data`` at ``prefix`` (anonymous memory if None)."""
    return data.memmap(prefix, copy_existing, **kwargs)


def load_memmap(
    prefix: Any, device: Any = None, non_blocking: bool = False, *, out: Any = None,
    robust_key: bool | None = True, subpath: Any = None, mode: str | None = None,
    num_threads: int = 0, allow_pickle: bool | None = None,
) -> Any:
    """Load a directory saved by shared_td or tensordict 0.15.3 (the class on disk).

    The options are those of ``TensorDict.load_memmap`` (``out`` is loaded in place by
    its own class's ``load_memmap``).
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
