"""Child-process targets for test_audit17_coord.py.

Importable by name. Each reports on a queue instead of dying silently, and never waits
without a timeout.
"""
import os
import resource


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
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hog = []
    try:
        # a low soft limit, then every descriptor up to it taken: this process, not the
        # coordinator, is out of descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
        try:
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        for attempt in (lambda: shared_td.attach("x", address=address, authkey=authkey, timeout=5),
                        ownership._known_embedded):
            try:
                attempt()
                outcomes.append(("returned", False, None, ""))
            except BaseException as err:
                outcomes.append((type(err).__name__, isinstance(err, ConnectionError),
                                 getattr(err, "errno", None), str(err)))
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    queue.put((outcomes, os.environ.get(ownership.ENV_VAR) is not None))
