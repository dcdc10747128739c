"""The layout of a consolidated tree: its one buffer and where each leaf lies in it.

A leaf of a consolidated tree is a contiguous view of the buffer, described by its
``(dtype, shape, byte offset)`` (an *entry*). Consecutive leaves of one dtype and shape
that lie back to back form a *run* ``(dtype, shape, byte offset, count)``: a 1000-node
tree of two small float leaves each is one run, so its pickle lists one run, and its
2000 views are made by one ``unbind`` (one C++ call instead of one ``as_strided`` per
leaf).
"""
from __future__ import annotations

import math
from typing import Any

import torch


class Layout:
    """The one storage of a consolidated tree: ``buffer`` (1-d uint8, its length a
    multiple of 64). Every node of the tree carries it, so a sub-tree pickles with the
    buffer once, not once per leaf.

    It also keeps the views it was made with (``record``) and where they lie, as entries
    or as runs (each made from the other when first asked for), so that pickling knows a
    leaf without asking torch (five calls per leaf); held here, a view's ``id`` names no
    other live object.
    """

    __slots__ = ("buffer", "views", "_entries", "_runs", "_positions")

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self.views: list[torch.Tensor] = []
        self._entries: list[tuple] | None = []
        self._runs: list[tuple] | None = []
        self._positions: dict[int, int] | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        """``td._consolidated["storage"]``: the buffer, under the name tensordict 0.15.3
        gives it in its ``_consolidated`` dict (code written for it reads it so)."""
        if key != "storage":
            raise KeyError(f"A consolidated layout has only 'storage' (the buffer), not {key!r}.")
        return self.buffer

    def record(self, views: list[torch.Tensor], *, entries: list[tuple] | None = None,
               runs: list[tuple] | None = None) -> None:
        """``views`` of the buffer, described by their entries, their runs, or both."""
        self.views, self._entries, self._runs, self._positions = views, entries, runs, None

    @property
    def entries(self) -> list[tuple]:
        """``(dtype, shape tuple, byte offset)`` of each recorded view, in order."""
        if self._entries is None:
            self._entries = entries_of(self._runs)
        return self._entries

    @property
    def runs(self) -> list[tuple]:
        """The recorded views as runs ``(dtype, shape tuple, byte offset, count)``."""
        if self._runs is None:
            self._runs = runs_of(self._entries)
        return self._runs

    @property
    def positions(self) -> dict[int, int]:
        """``{id(view): its index in views}`` (made when a pickle first needs it)."""
        if self._positions is None:
            self._positions = {id(view): position for position, view in enumerate(self.views)}
        return self._positions


def c_strides(shape: Any) -> list[int]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def runs_of(entries: list[tuple]) -> list[tuple]:
    """``entries`` ``(dtype, shape, byte offset)`` merged into runs ``(dtype, shape, byte
    offset, count)``: consecutive entries of one dtype and shape, back to back (empty
    leaves each make a run of their own)."""
    runs: list[tuple] = []
    start, count = 0, len(entries)
    while start < count:
        dtype, shape, offset = entries[start]
        step = math.prod(shape) * dtype.itemsize
        end, after = start + 1, offset + step
        while step and end < count and entries[end][2] == after and entries[end][0] is dtype \
                and entries[end][1] == shape:
            end, after = end + 1, after + step
        runs.append((dtype, shape, offset, end - start))
        start = end
    return runs


def entries_of(runs: list[tuple]) -> list[tuple]:
    """The entries of each leaf of ``runs`` (the inverse of :func:`runs_of`)."""
    entries = []
    for dtype, shape, offset, count in runs:
        step = math.prod(shape) * dtype.itemsize
        entries.extend((dtype, shape, offset + i * step) for i in range(count))
    return entries


def views_of_runs(buffer: torch.Tensor, runs: list[tuple]) -> list[torch.Tensor]:
    """The views of ``buffer`` (1-d uint8, its length a multiple of 64) that ``runs``
    describe, in order, each a contiguous tensor: one ``unbind`` per run of several
    leaves, one ``as_strided`` for a run of one."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views: list[torch.Tensor] = []
    for dtype, shape, offset, count in runs:
        whole = typed.get(dtype)
        if whole is None:
            # (a buffer read from a file may end inside an element: view whole ones)
            whole = typed[dtype] = buffer[:buffer.numel() - buffer.numel() % dtype.itemsize].view(dtype)
        if count > 1:
            first, numel = offset // dtype.itemsize, math.prod(shape)
            views.extend(whole[first:first + numel * count].view(count, *shape).unbind(0))
        else:
            views.append(whole.as_strided(shape, c_strides(shape), offset // dtype.itemsize))
    return views


def placed_views(buffer: torch.Tensor, sources: list, offsets: list[int],
                 order: list[int]) -> tuple[list[torch.Tensor], list[tuple] | None, list[tuple] | None]:
    """Each of ``sources``' place in ``buffer`` (at byte ``offsets[i]``; ``order``: the
    indices in the order of their offsets) as a contiguous tensor of its dtype and
    shape, in the sources' order, and where they lie: their runs, or (if ``order`` is
    not the sources' order) their entries. The small leaves of a packed layout lie back
    to back, so each run of them of one dtype and shape is one ``unbind``."""
    runs: list[list] = []  # [dtype, shape tuple, byte offset, count], in packing order
    run_dtype = run_shape = None
    after = -1  # where the current run ends (-1: it cannot grow, as after an empty leaf)
    for index in order:
        source = sources[index]
        dtype, shape, offset = source.dtype, source.shape, offsets[index]
        if offset == after and dtype is run_dtype and shape == run_shape:
            runs[-1][3] += 1
        else:
            runs.append([dtype, tuple(shape), offset, 1])
            run_dtype, run_shape = dtype, shape
            step = source.numel() * dtype.itemsize
        after = offset + step if step else -1
    runs = [tuple(run) for run in runs]
    placed = views_of_runs(buffer, runs)
    if order == list(range(len(sources))):  # (packing keeps the order of leaves of one element size)
        return placed, None, runs
    views: list = [None] * len(sources)
    in_order: list = [None] * len(sources)
    for index, view, entry in zip(order, placed, entries_of(runs)):
        views[index], in_order[index] = view, entry
    return views, in_order, None
