"""TensorDictFuture: the handle returned by ``memmap_(..., return_early=True)``."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any

# resulting_td not known when the future is made: the tree is built by the write
_NOT_YET_BUILT = object()


class TensorDictFuture:
    """A memory-mapping write running in background threads.

    ``memmap_``, ``memmap``, ``memmap_like``, ``save`` and ``consolidate`` return one
    when called with ``return_early=True`` and ``num_threads > 1``. ``result()`` waits
    for every file to be written and returns the tensordict; if a write failed it
    raises that error (nothing is half-converted: see ``memmap_``). A failed write
    whose error nobody read (``result()``, ``exception()``, ``resulting_td``, or the
    ``result()`` of one of ``futures``) gives a RuntimeWarning naming it when its future
    is freed, as asyncio's "Future exception was never retrieved".

    Attributes (as tensordict 0.15.3's ``TensorDictFuture``):
        futures: the list of ``concurrent.futures.Future`` to wait for, e.g. with
            ``concurrent.futures.wait(future.futures)``. Here it holds one future, the
            whole write (tensordict's holds one per write job).
        resulting_td: the tensordict that ``result()`` returns. For ``memmap_`` it is
            the source itself, at once, as in tensordict. A copy (``memmap``,
            ``memmap_like``, ``save``) is built once its files are written, so there
            reading it waits for the write and raises its error (tensordict gives a
            tree whose leaves are still being written); so does ``consolidate``'s.

    Examples:
        >>> import concurrent.futures, tempfile, torch, shared_td
        >>> td = shared_td.TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
        >>> with tempfile.TemporaryDirectory() as path:
        ...     future = td.memmap_(path, num_threads=2, return_early=True)
        ...     print(future.resulting_td is td)
        ...     _ = concurrent.futures.wait(future.futures)
        ...     print(future.result() is td, td.is_memmap())
        True
        True True
    """

    def __init__(self, future: Future, description: str, resulting_td: Any = _NOT_YET_BUILT):
        self._future = future
        self._description = description
        self._resulting_td = resulting_td

    @property
    def futures(self) -> list[Future]:
        """The futures to wait for (one: the whole write), as tensordict's ``futures``.

        Example:
            >>> import concurrent.futures, tempfile, torch, shared_td
            >>> td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
            >>> with tempfile.TemporaryDirectory() as path:
            ...     future = td.memmap(path, num_threads=2, return_early=True)
            ...     done, _ = concurrent.futures.wait(future.futures, timeout=60)
            ...     print(len(done), future.result()["a"].tolist())
            1 [1.0, 1.0, 1.0]
        """
        return [self._future]

    @property
    def resulting_td(self) -> Any:
        """The tensordict ``result()`` returns: the source of an in-place write at once;
        a copy once written (this waits for the write, and raises its error).

        Example:
            >>> import tempfile, torch, shared_td
            >>> td = shared_td.TensorDict(a=torch.ones(3), batch_size=[3])
            >>> with tempfile.TemporaryDirectory() as path:
            ...     copy = td.memmap(path, num_threads=2, return_early=True).resulting_td
            ...     print(copy is td, copy.is_memmap())
            False True
        """
        if self._resulting_td is _NOT_YET_BUILT:
            return self._future.result()
        return self._resulting_td

    def result(self, timeout: float | None = None) -> Any:
        """Wait (at most ``timeout`` seconds) and return the tensordict, or raise."""
        return self._future.result(timeout)

    def done(self) -> bool:
        """True once the write has finished, successfully or not."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error of a failed write (None on success), after waiting for it."""
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"TensorDictFuture({self._description}, {state})"
