"""Finalizers that never swallow a Ctrl-C: :class:`Finalizer`.

Python runs a signal's handler between two bytecodes of whatever code runs then, so a
Ctrl-C that arrives while a ``weakref.finalize`` callback runs raises its
KeyboardInterrupt *inside the callback*, and Python drops an exception raised there
(it prints "Exception ignored in: <finalize object ...>"): the program goes on as if
the key had never been pressed. A worker looping on ``from_consolidated`` or ``attach``,
whose old trees are unmapped by finalizers, went on running after 1 Ctrl-C in 4 (loads)
or in 12 to 30 (attaches).

A :class:`Finalizer` is a ``weakref.finalize`` whose dropped KeyboardInterrupt is
raised again: the first one made installs a ``sys.unraisablehook`` (in front of whatever
hook was there, which still gets every other report) that, for a KeyboardInterrupt
dropped by a Finalizer (or by a weak reference's callback or ``__del__`` of shared_td),
runs that finalizer if it had not begun yet (its ``alive``), then has a new thread send
SIGINT to the main thread again. Not the hook itself: Python checks for signals right
after each call, so a signal it sent would be raised in the hook, and dropped again.
The new thread runs once the main thread lets it (at its next switch or blocking call:
outside this finalizer); a blocking call of the main thread ends with EINTR as for a
Ctrl-C. The hook is put back if something replaced it when the next Finalizer is made.

What its callback does decides the rest, so our callbacks are C functions (``os.close``,
:data:`shared_td.platform.unmap_bytes`): no bytecode runs inside them, and the
interrupt lands before the cleanup (it is still ``alive``: the hook runs it) or after
it. Limits: between ``weakref.finalize`` taking the callback out of its registry and
calling it (one dict lookup) a landing interrupt still skips that cleanup (it is raised
again all the same); a callback written in Python may be cut anywhere, as any code; a
Ctrl-C landing in another library's finalizer is Python's to drop.

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
    """``weakref.finalize(obj, func, *args, **kwargs)`` whose Ctrl-C is never lost (see
    the module's docstring); ``func`` should be a C function (``os.close``)."""

    __slots__ = ()

    def __init__(self, obj, func, /, *args, **kwargs):
        if sys.unraisablehook is not _raise_ctrl_c_again:
            _install()
        super().__init__(obj, func, *args, **kwargs)


_previous_hook = sys.unraisablehook


def _install() -> None:
    global _previous_hook
    _previous_hook = sys.unraisablehook
    sys.unraisablehook = _raise_ctrl_c_again


def _raise_ctrl_c_again(unraisable) -> None:
    dropped_by = unraisable.object
    if not (unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt)
            and _is_ours(dropped_by)):
        _previous_hook(unraisable)
        return
    try:
        if isinstance(dropped_by, Finalizer) and dropped_by.alive:  # (landed before its callback began)
            dropped_by()
    finally:
        try:
            _thread.start_new_thread(_send_ctrl_c, (threading.main_thread().ident,))
        except RuntimeError:  # (no new thread at interpreter shutdown: it is ending anyway)
            pass


def _is_ours(dropped_by) -> bool:
    """Whether ``dropped_by`` (a finalizer, a weak reference's callback, a ``__del__``) is
    shared_td's: a Ctrl-C landing in another library's is that library's to keep."""
    if isinstance(dropped_by, Finalizer):
        return True
    function = getattr(dropped_by, "func", dropped_by)  # (a functools.partial's)
    return str(getattr(function, "__module__", "")).startswith("shared_td.")


def _send_ctrl_c(main_thread: int) -> None:
    if callable(signal.getsignal(signal.SIGINT)):  # (still a Python handler, as the one that raised)
        signal.pthread_kill(main_thread, signal.SIGINT)
