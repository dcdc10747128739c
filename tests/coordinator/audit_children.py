"""Child-process targets for test_audit_fixes.py.

Importable by name, so that spawn children find them. Each reports on a queue instead of
dying silently, and never waits without a timeout.
"""
import fcntl
import os
import time

import shared_td

WAIT = 30  # seconds: the bound on every wait here


def attach_for(address, authkey, name, seconds, how, queue):
    """Attach ``name`` again and again for ``seconds`` (``how``: "attach" each time, or
    "refresh" a view whenever it is stale) while the parent republishes or unpublishes
    it; report ("done", attaches, KeyErrors, torn versions, other errors, a sample)."""
    try:
        ok = missing = torn = other = 0
        sample = None
        view = shared_td.attach(name, address=address, authkey=authkey, timeout=WAIT)
        queue.put(("ready",))
        stop_at = time.monotonic() + seconds
        while time.monotonic() < stop_at:
            try:
                if how == "refresh":
                    if not shared_td.is_stale(view):
                        continue
                    view = shared_td.refresh(view)
                else:
                    view = shared_td.attach(name, address=address, authkey=authkey, timeout=WAIT)
                ok += 1
                # a whole version: both leaves were filled with the same value before it
                # was published
                a, b = view["a"], view["b"]
                if not (a == a[0]).all() or not (b == a[0]).all():
                    torn += 1
            except KeyError:
                missing += 1
            except Exception as err:  # what the race used to raise
                other += 1
                sample = sample or f"{type(err).__name__}: {err}"
        queue.put(("done", ok, missing, torn, other, sample))
    except BaseException as err:
        queue.put(("error", repr(err)))
        raise


def refresh_after_kill(address, authkey, name, go, queue):
    """Attach ``name``, report, wait for ``go`` (the manager is killed meanwhile), then
    report what is_stale and refresh say."""
    try:
        view = shared_td.attach(name, address=address, authkey=authkey, timeout=WAIT)
        queue.put(("ready",))
        if not go.wait(WAIT):
            queue.put(("error", "never told to go"))
            return
        stale = shared_td.is_stale(view)
        try:
            shared_td.refresh(view)
            queue.put(("returned", stale, None))
        except ConnectionError as err:
            queue.put(("ConnectionError", stale, str(err)))
    except BaseException as err:
        queue.put(("error", repr(err)))
        raise


def hold_flock(path, queue):
    """Take the flock of directory ``path`` (as a manager holds its own), report, and
    sleep until killed."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    queue.put(("locked", os.getpid()))
    time.sleep(WAIT * 4)
