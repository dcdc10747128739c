"""Child-process targets for test_audit17_coord.py.

Importable by name. Each reports on a queue instead of dying silently, and never waits
without a timeout.
"""
import contextlib
import os
import resource


@contextlib.contextmanager
def descriptors_taken():
    """A low soft RLIMIT_NOFILE, then every descriptor up to it taken: this process, not
    the coordinator, is out of descriptors inside the block (restored after it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        yield
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _outcome(err: BaseException) -> tuple:
    return type(err).__name__, isinstance(err, ConnectionError), getattr(err, "errno", None), str(err)


def out_of_descriptors(address, authkey, queue):
    """With no descriptor left in this process, attach from the coordinator at
    ``address`` and look for the coordinator announced in the environment (that same
    one); report how each ended: ``(type name, is ConnectionError, errno, message)``,
    and whether the announcement is still in the environment."""
    from shared_td.coordinator import ownership

    import shared_td

    os.environ[ownership.ENV_VAR] = f"{address};{authkey.hex()}"
    ownership._EMBEDDED = None  # (a fork child: nothing known yet but the environment)
    outcomes = []
    with descriptors_taken():
        for attempt in (lambda: shared_td.attach("x", address=address, authkey=authkey, timeout=5),
                        ownership._known_embedded):
            try:
                attempt()
                outcomes.append(("returned", False, None, ""))
            except BaseException as err:
                outcomes.append(_outcome(err))
    queue.put((outcomes, os.environ.get(ownership.ENV_VAR) is not None))


def publish_without_descriptors(coord, queue):
    """With no descriptor left in this process, publish a small tree through ``coord``
    (a handle of the test's Coordinator); report how it ended, as out_of_descriptors."""
    import torch

    import shared_td

    td = shared_td.TensorDict(a=torch.ones(2), batch_size=[2])
    with descriptors_taken():
        try:
            coord.publish("y", td)
            outcome = ("returned", False, None, "")
        except BaseException as err:
            outcome = _outcome(err)
    queue.put(outcome)
