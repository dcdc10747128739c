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
code; a hook that replaced ours turns this off until the next Finalizer is made. A
KeyboardInterrupt dropped in another thread than the main one is no Ctrl-C (Python
raises a signal's in the main thread only): it is reported as any other.

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
import os
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
        if not isinstance(sys.unraisablehook, _Hook):
            _put_in_front()
        super().__init__(obj, func, *args, **kwargs)


class _Hook:
    """shared_td's hook as put in front of ``replaced``, the hook in place then, which
    gets every other report. One object per placement, each with its own ``replaced``:
    a hook that chains to an earlier placement reaches that one, which hands the report
    on to its own (never back to the same hook: a RecursionError), and one restored by
    whoever replaced it (``old = sys.unraisablehook``, later ``sys.unraisablehook =
    old``) hands on to the hook it replaced then, not to the replacement now gone."""

    __slots__ = ("replaced",)

    def __init__(self, replaced) -> None:
        self.replaced = replaced

    def __call__(self, unraisable) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
            self.replaced(unraisable)
            return
        try:
            dropped_by = unraisable.object
            if isinstance(dropped_by, Finalizer) and dropped_by.alive:  # (landed before its callback began)
                dropped_by()
        finally:
            main_thread = threading.main_thread().ident
            if _thread.get_ident() != main_thread:
                # not a Ctrl-C: Python raises a signal's only in the main thread (this one
                # was raised in this thread: an asynchronous exception, a raise): reported
                self.replaced(unraisable)
            else:
                try:
                    _thread.start_new_thread(_send_ctrl_c, (main_thread,))
                except RuntimeError:  # (no new thread at interpreter shutdown: it is ending anyway)
                    pass


_installing = threading.Lock()


def _new_lock_in_child() -> None:
    global _installing
    _installing = threading.Lock()  # (a thread of the parent may have held it at the fork)


os.register_at_fork(after_in_child=_new_lock_in_child)


def _put_in_front() -> None:
    with _installing:
        if not isinstance(sys.unraisablehook, _Hook):
            sys.unraisablehook = _Hook(sys.unraisablehook)


def _send_ctrl_c(main_thread: int) -> None:
    if callable(signal.getsignal(signal.SIGINT)):  # (still a Python handler, as the one that raised)
        signal.pthread_kill(main_thread, signal.SIGINT)


_put_in_front()  # at import; again at the next Finalizer made after another hook replaced it
