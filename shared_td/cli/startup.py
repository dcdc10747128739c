"""Ctrl-C while the command line is still starting: one line and exit code 130.

``python -m shared_td ...`` and ``shared-td ...`` import the package (torch with it, a
second or two) before :func:`shared_td.cli.main` runs, so a Ctrl-C then would print
Python's traceback of the import instead of the one line ``main`` prints for it. The
package calls :func:`quiet_interrupt_while_starting` first thing: in such a process, and
only there (a program importing shared_td keeps its KeyboardInterrupt), a SIGINT until
``main`` starts prints ``shared-td: interrupted`` and exits with 130 (128 + SIGINT, the
shell's code for it). ``main`` puts Python's handler back (:func:`started`) and catches
KeyboardInterrupt itself from there on.

Example:
    >>> import signal
    >>> quiet_interrupt_while_starting()   # not the command line: nothing changes
    >>> signal.getsignal(signal.SIGINT) is signal.default_int_handler
    True
"""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["INTERRUPTED", "quiet_interrupt_while_starting", "started"]

#: The exit code of an interrupted command (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def _is_command_line() -> bool:
    """This process runs the command line and is importing the package for it (not a
    spawned child of it: that one gets its parent's ``sys.argv``, not its command)."""
    argv = getattr(sys, "argv", None) or [""]
    words = getattr(sys, "orig_argv", None) or []  # this process's own command
    if os.path.basename(argv[0]) == "shared-td":  # the console script of pyproject.toml
        return argv[0] in words
    if argv[0] != "-m":  # runpy sets argv[0] to "-m" while it imports the package it runs
        return False
    for index, word in enumerate(words[1:], 1):
        if word.startswith("-m"):  # "-m shared_td" or "-mshared_td"
            return (word[2:] or "".join(words[index + 1:index + 2])) == "shared_td"
    return False


def _interrupted(signum: int, frame) -> None:
    os.write(2, b"shared-td: interrupted\n")  # (not sys.stderr: it may be mid-write)
    # Exit at once, unwinding nothing: an exception raised into the import under way can
    # be swallowed by C code (torch's import of numpy drops it, and the command then ran
    # to its end with exit 0, or failed re-importing a half-imported numpy). Before
    # ``main`` nothing of ours is live: no child, no file, no output to flush.
    os._exit(INTERRUPTED)


def quiet_interrupt_while_starting() -> None:
    """In the command line's process, make a Ctrl-C before :func:`started` one line on
    stderr and exit code 130 (see the module doc); elsewhere, nothing."""
    if (_is_command_line() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):  # (not an ignored SIGINT)
        signal.signal(signal.SIGINT, _interrupted)


def started() -> None:
    """The command line's ``main`` runs: SIGINT is Python's KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
