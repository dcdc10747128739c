"""Child-process targets for test_coordinator.py.

They live in their own module, importable by name, so that spawn children (which import
the target instead of inheriting it) find them. Each reports on a queue or pipe instead
of dying silently, and never waits without a timeout.
"""
import os
import time

import torch

import shared_td


def attach_write_read(address, authkey, name, key, value, queue):
    """Attach ``name``, write ``value`` into row 1 of ``key``, report what row 0 holds."""
    try:
        td = shared_td.attach(name, address=address, authkey=authkey)
        td[key][1] = value
        queue.put(("ok", td[key][0].tolist(), td.is_locked))
    except BaseException as err:
        queue.put(("error", repr(err), None))
        raise


def attach_with_handle(coord, name, key, value, queue):
    """Same through a pickled Coordinator handle (a non-owning one in this process)."""
    try:
        td = coord.attach(name)
        td[key][1] = value
        queue.put(("ok", coord.names(), repr(coord)))
    except BaseException as err:
        queue.put(("error", repr(err), None))
        raise


def publish_and_exit(address, authkey, name, queue):
    """Publish an anonymous tensordict of 7s, report its memfd inode, and exit."""
    try:
        coord = shared_td.Coordinator.connect(address, authkey)
        td = coord.publish(name, shared_td.TensorDict(x=torch.full((3,), 7.0), batch_size=[3]))
        queue.put(("ok", os.getpid(), td["x"]._backing.key))
    except BaseException as err:
        queue.put(("error", repr(err), None))
        raise


def write_forever(address, authkey, name, key, queue):
    """Attach and keep writing increasing values into ``key`` until killed."""
    td = shared_td.attach(name, address=address, authkey=authkey)
    queue.put("attached")
    i = 0
    while True:
        i += 1
        td[key].fill_(float(i))


def own_coordinator_then_wait(prefix, queue):
    """Start a Coordinator here, publish file-backed and anonymous data, report, sleep."""
    coord = shared_td.Coordinator().start()
    coord.publish("anon", shared_td.TensorDict(a=torch.ones(2)))
    coord.publish("file", shared_td.TensorDict(b=torch.ones(2)), prefix=prefix)
    queue.put((coord.address, coord.authkey, coord.pid))
    time.sleep(120)


def fill_leaf(tds, key, value, queue):
    """Write into tensordicts received as a plain Process argument (no coordinator)."""
    for td in tds:
        td[key].fill_(value)
    queue.put("ok")


def attach_timed(address, authkey, name, timeout, queue):
    """Attach ``name`` with ``timeout``; report how it ended and how long it took:
    ``(outcome, is ConnectionError, is TimeoutError, message, seconds)``."""
    started = time.monotonic()
    try:
        shared_td.attach(name, address=address, authkey=authkey, timeout=timeout)
        queue.put(("attached", False, False, "", time.monotonic() - started))
    except BaseException as err:
        queue.put((type(err).__name__, isinstance(err, ConnectionError),
                   isinstance(err, TimeoutError), str(err), time.monotonic() - started))


def stop_own_manager_then_leave(queue):
    """Start a Coordinator, report its manager's pid, SIGSTOP that manager, then leave
    the ``with`` block (which must stop the manager anyway) and report the seconds the
    shutdown took."""
    import signal

    with shared_td.Coordinator(timeout=1) as coord:
        coord.publish("x", shared_td.TensorDict(a=torch.ones(2)))
        manager = coord.pid
        queue.put(("manager", manager, coord.address))
        os.kill(manager, signal.SIGSTOP)
        started = time.monotonic()
    queue.put(("left", time.monotonic() - started, None))


def publish_mixed_and_exit(address, authkey, name, queue):
    """Publish a tree of anonymous leaves (one nested) and a shared non-tensor value,
    report, and exit: afterwards only the manager holds their memory."""
    try:
        coord = shared_td.Coordinator.connect(address, authkey)
        td = shared_td.TensorDict(x=torch.full((3,), 7.0), inner={"y": torch.arange(3.0)},
                                  task="walk", batch_size=[3])
        coord.publish(name, td, share_non_tensor=True)
        queue.put(("ok", os.getpid()))
    except BaseException as err:
        queue.put(("error", repr(err)))
        raise


def attach_twice_and_write(address, authkey, name, queue):
    """Attach ``name`` twice (the second from this process's parsed layout, when the
    parent had parsed it before a fork), write through the second, report what the first sees."""
    try:
        first = shared_td.attach(name, address=address, authkey=authkey)
        second = shared_td.attach(name, address=address, authkey=authkey)
        second["x"][0] = -5.0
        queue.put(("ok", first["x"].tolist(), second is not first, shared_td.is_stale(second)))
    except BaseException as err:
        queue.put(("error", repr(err), None, None))
        raise
