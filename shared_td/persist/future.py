"""TensorDictFuture: the handle returned by ``memmap_(..., return_early=True)``."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class TensorDictFuture:
    """A memory-mapping write running in background threads.

    ``result()`` waits for every file to be written and returns the tensordict; if a
    write failed it raises that error (nothing is half-converted: see ``memmap_``).

    Examples:
        >>> td = shared_td.TensorDict(obs=torch.zeros(3, 4), batch_size=[3])
        >>> future = td.memmap_("data/saved", num_threads=2, return_early=True)
        >>> td = future.result()
        >>> td.is_memmap(), td["obs"].filename.endswith("data/saved/obs.memmap")
        (True, True)
    """

    def __init__(self, future: Future, description: str):
        self._future = future
        self._description = description

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
