"""Finalizers that never swallow a Ctrl-C: :class:`Finalizer`.

Python runs a signal's handler between two bytecodes of whatever code runs then, so a
Ctrl-C that arrives while a ``weakref.finalize`` callback runs raises its
KeyboardInterrupt *inside the callback*, and Python drops an exception raised there
(it prints "Exception ignored in: <finalize object ...>"): the program goes on as if
the key had never been pressed. A worker looping on ``from_consolidated`` or ``attach``,
whose old trees are unmapped by finalizers, went on running after 1 Ctrl-C in 4 (loads)
or in 12 to 30 (attaches).

Importing this module (shared_td does) puts a ``sys.unraisablehook`` in front of the
one in place, which still gets every other report, and puts it back in front when a
Finalizer is made after another hook replaced it (pytest installs its own once it has
imported the conftest files). For a dropped KeyboardInterrupt it
runs the :class:`Finalizer` that dropped it if that had not begun yet (its ``alive``),
then has a new thread send SIGINT to the main thread again. Not the hook itself: Python
checks for signals right after each call, so a signal it sent would be raised in the
hook, and dropped again. The new thread runs once the main thread lets it (at its next
switch or blocking call: outside the finalizer); a blocking call of the main thread
ends with EINTR as for a Ctrl-C. Any dropped KeyboardInterrupt, not only one of
shared_td's finalizers: most land in Python's own callbacks of the weak containers
that shared_td's caches are (an attach loop lost 4 Ctrl-C in 150 there), and one
dropped in another library's finalizer is as lost to the user.

What a Finalizer's callback does decides the rest, so ours are C functions
(``os.close``, :data:`shared_td.platform.unmap_bytes`): no bytecode runs inside them,
and the interrupt lands before the cleanup (it is still ``alive``: the hook runs it) or
after it. Limits: between ``weakref.finalize`` taking the callback out of its registry
and calling it (one dict lookup) a landing interrupt still skips that cleanup (it is
raised again all the same); a callback written in Python may be cut anywhere, as any
code; a hook that replaced ours turns this off until the next Finalizer is made, and
one that was in place then and was itself replaced since keeps getting the reports.

Example:
    >>> import os, time, _thread
    >>> class Owner: pass
    >>> owner, fd = Owner(), os.open(os.devnull, os.O_RDONLY)
    >>> closing = Finalizer(owner, os.close, fd)
    >>> ctrl_c = Finalizer(owner, _thread.interrupt_main)  # (runs first: a Ctrl-C landing in it)
    >>> try:
    ...     del owner
    ...     time.sleep(5)  # (the interrupt ends it, here, outside any finalizer)
    ... except KeyboardInterrupt:
    ...     print("raised; descriptor closed:", not closing.alive)
    raised; descriptor closed: True
"""
from __future__ import annotations

import _thread
import signal
import sys
import threading
import weakref

__all__ = ["Finalizer"]


class Finalizer(weakref.finalize):
    """``weakref.finalize(obj, func, *args, **kwargs)`` whose Ctrl-C is never lost: run
    by the hook when one landed before its callback began (see the module's
    docstring); ``func`` should be a C function (``os.close``)."""

    __slots__ = ()

    def __init__(self, obj, func, /, *args, **kwargs):
        if sys.unraisablehook is not _raise_ctrl_c_again:
            _put_in_front()
        super().__init__(obj, func, *args, **kwargs)


# Each hook that shared_td's was put in front of, oldest first. A hook put in front of
# ours may chain to it (the usual idiom) and then find ours in front of it again: the
# chain comes back to ours, which hands the report to the hook before that one (not to
# the same one again: a RecursionError, and the report lost).
_replaced: list = []
_forwarding = threading.local()  # .depth: how many of _replaced this thread's report went through
_installing = threading.Lock()


def _put_in_front() -> None:
    with _installing:
        if sys.unraisablehook is not _raise_ctrl_c_again:
            _replaced.append(sys.unraisablehook)
            sys.unraisablehook = _raise_ctrl_c_again


def _raise_ctrl_c_again(unraisable) -> None:
    depth = getattr(_forwarding, "depth", 0)
    if depth or unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
        _hand_on(unraisable, depth)
        return
    try:
        dropped_by = unraisable.object
        if isinstance(dropped_by, Finalizer) and dropped_by.alive:  # (landed before its callback began)
            dropped_by()
    finally:
        try:
            _thread.start_new_thread(_send_ctrl_c, (threading.main_thread().ident,))
        except RuntimeError:  # (no new thread at interpreter shutdown: it is ending anyway)
            pass


def _hand_on(unraisable, depth: int) -> None:
    """The report to the hook ours replaced, or, when the chain came back to ours from
    that one, to the one before it."""
    if depth >= len(_replaced):  # (every hook of the chain has had it)
        return
    _forwarding.depth = depth + 1
    try:
        _replaced[-1 - depth](unraisable)
    finally:
        _forwarding.depth = depth


def _send_ctrl_c(main_thread: int) -> None:
    if callable(signal.getsignal(signal.SIGINT)):  # (still a Python handler, as the one that raised)
        signal.pthread_kill(main_thread, signal.SIGINT)


_put_in_front()  # at import; again at the next Finalizer made after another hook replaced it
