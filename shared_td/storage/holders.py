"""Fallback holders of an anonymous segment: processes other than its sender that hold it.

A segment that a process attached from a Coordinator is held by the coordinator's
manager process for as long as the name stays published, whatever becomes of the
process that sends it on. A pickle of such a segment (a tree attached from a
coordinator, or a plain view of one of its leaves, put on a queue by a worker) names
those holders after its sender, as a pickled
:class:`~shared_td.storage.shared_value.SharedValue` names the coordinators that adopted
it; a receiver that cannot reach the sender (it exited, so its duplicate descriptor and
its ``/proc/<pid>/fd`` are gone) opens a holder's descriptor instead, with the same
checks (the inode, the size). A segment that no coordinator holds has no holders, and
pickles and fails as before.

The holders are kept on the segment's storage (as :data:`HOLDERS_ATTRIBUTE`), not on the
:class:`~shared_td.storage.anonymous.Segment` object: a plain view (``detach()``,
``view()``, ``.data``) keeps the storage, and is sent with them once the Segment object
is gone. This module knows nothing of how a route is opened: :func:`open_first` is given
that (:func:`shared_td.storage.anonymous.attach_peer_fd`).

Example:
    >>> import torch
    >>> storage = torch.UntypedStorage(8)
    >>> add_holders(storage, [(4242, 7)]); add_holders(storage, [(4242, 7), (4343, 9)])
    >>> holders_of(storage), holders_of(torch.UntypedStorage(8))
    (((4242, 7), (4343, 9)), ())
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from shared_td.errors import SegmentUnavailableError

__all__ = ["HOLDERS_ATTRIBUTE", "add_holders", "holders_of", "open_first"]

#: the attribute of a segment's storage holding the ``(pid, fd)`` of its holders
HOLDERS_ATTRIBUTE = "_shared_td_holders"


def holders_of(storage) -> tuple[tuple[int, int], ...]:
    """``(pid, fd)`` of the processes known to hold the segment mapped as ``storage``
    besides this one (coordinators), in the order they were learnt; ``()`` if none."""
    return getattr(storage, HOLDERS_ATTRIBUTE, ())


def add_holders(storage, holders: Iterable) -> None:
    """Record more ``(pid, fd)`` holders of the segment mapped as ``storage`` (once each)."""
    known = holders_of(storage)
    merged = tuple(dict.fromkeys((*known, *(tuple(holder) for holder in holders))))
    if merged != known:
        setattr(storage, HOLDERS_ATTRIBUTE, merged)


def open_first(sender: tuple[int, int], holders: Iterable, open_route: Callable[[int, int], Any], *,
               what: str, key: tuple[int, int], advice: str) -> Any:
    """``open_route(pid, fd)`` of the sender, else of each holder in turn, with the
    first that works. Only a :class:`SegmentUnavailableError` moves on to the next route
    (an error of this process's own, out of descriptors, is raised at once: no route
    would do better). With holders, the error when every route failed names each route
    and why it failed, then ``advice``; ``open_route`` is called with no advice of its own
    then (so it is said once). With none, the sender's own error is raised unchanged."""
    holders = tuple(tuple(holder) for holder in holders if tuple(holder) != tuple(sender))
    if not holders:
        return open_route(*sender, advice=advice)
    failures = []
    for index, (pid, fd) in enumerate((tuple(sender), *holders)):
        try:
            return open_route(pid, fd, advice="")
        except SegmentUnavailableError as err:
            who = "its sender" if index == 0 else "a coordinator holding it"
            failures.append(f"{who}, process {pid} (descriptor {fd}): {str(err).strip().rstrip('.')}")
    tried = "; ".join(f"({number}) {failure}" for number, failure in enumerate(failures, 1))
    raise SegmentUnavailableError(
        f"The {what} (inode {key[1]}) could not be attached from any process that held it. "
        f"Routes tried, in order: {tried}. A coordinator holds a segment while its name stays "
        "published (not once it is published again or unpublished, or the coordinator stopped): "
        f"attach the name again. {advice}")
