"""Latency of reading an unchanged shared non-tensor value, three ways.

* ``shared_td``: ``td["task"]`` after ``memmap_(share_non_tensor=True)``: one load of
  the value's version word from shared memory, then the cached object.
* ``tensordict``: the same read in tensordict 0.15.3 (a str is a 100-byte
  ``mp.Array`` that is decoded on every read); None if tensordict is not installed.
* ``manager_proxy``: ``proxy["task"]`` of a ``multiprocess.Manager().dict()``: one
  round trip to the manager process per read.

Each is the best of ``repeat`` timed loops, in microseconds per read.

Run:  python benchmarks/nontensor_read.py
"""
from __future__ import annotations

import time

VALUE = "walk to the door"  # under tensordict's 100-byte limit for shared strings


def _per_call_us(read, calls: int, repeat: int) -> float:
    read()  # warm: caches, connections
    best = float("inf")
    for _ in range(repeat):
        begin = time.perf_counter()
        for _ in range(calls):
            read()
        best = min(best, (time.perf_counter() - begin) / calls)
    return best * 1e6


def _shared_td(repeat: int) -> float:
    import shared_td

    td = shared_td.TensorDict(task=VALUE).memmap_(share_non_tensor=True)
    assert td["task"] == VALUE
    return _per_call_us(lambda: td["task"], 20_000, repeat)


def _tensordict(repeat: int) -> float | None:
    try:
        import tensordict
    except ImportError:
        return None
    td = tensordict.TensorDict(task=VALUE).memmap_(share_non_tensor=True)
    assert td["task"] == VALUE
    return _per_call_us(lambda: td["task"], 20_000, repeat)


def _manager_proxy(repeat: int) -> float:
    import multiprocess

    with multiprocess.Manager() as manager:
        proxy = manager.dict(task=VALUE)
        return _per_call_us(lambda: proxy["task"], 1_000, repeat)


def measure(repeat: int = 3) -> dict:
    """Per-read latency (µs) of an unchanged value: ``{"shared_td": ..., "tensordict":
    ... or None, "manager_proxy": ...}``.

    Example:
        >>> result = measure(repeat=1)                 # doctest: +SKIP
        >>> result["shared_td"] < result["manager_proxy"]
        True
    """
    return {
        "shared_td": _shared_td(repeat),
        "tensordict": _tensordict(repeat),
        "manager_proxy": _manager_proxy(repeat),
    }


if __name__ == "__main__":
    for name, micros in measure().items():
        shown = "not installed" if micros is None else f"{micros:8.2f} us"
        print(f"{name:14s} {shown}")
