"""A coordinator started under real limits: the errors name the limit (tests run in a child)."""
import os
import subprocess
import sys
import textwrap

import shared_td

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shared_td.__file__)))  # (the package the tests import)


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_publish_under_a_small_rlimit_fsize_names_the_manager_and_the_limit():
    out = _run("""
        import errno, resource, signal, torch, shared_td
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (5000, resource.RLIM_INFINITY))
        with shared_td.Coordinator() as co:
            try:
                co.publish("x", shared_td.TensorDict(a=torch.zeros(4), batch_size=[4]))
            except OSError as e:
                assert e.errno == errno.EFBIG, e
                print("ERR", e)
    """)
    assert "ERR" in out and "RLIMIT_FSIZE" in out and "manager process" in out, out


def test_starting_a_coordinator_out_of_descriptors_names_rlimit_nofile():
    out = _run("""
        import errno, os, resource, torch, shared_td
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, hard))
        try:
            with shared_td.Coordinator():
                pass
        except OSError as e:
            assert e.errno == errno.EMFILE, e
            print("ERR", e)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with shared_td.Coordinator() as co:   # works again once the limit is lifted
            co.publish("x", shared_td.TensorDict(a=torch.zeros(4), batch_size=[4]))
            print("AGAIN OK")
    """)
    assert "ERR" in out and "RLIMIT_NOFILE" in out and "AGAIN OK" in out, out


def test_a_manager_short_of_address_space_fails_the_start_naming_rlimit_as():
    # the manager inherits RLIMIT_AS; too low for its watch thread's stack, it exited once
    # it had reported its address: start() succeeded and the first call said it was "gone".
    # Over a scan of levels, each start either fails naming the limit or gives a manager
    # that serves the first call (made with the limit lifted in this process) or, short of
    # threads for it, says so naming its limit.
    out = _run("""
        import resource, torch, shared_td
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        for mib in range(18, 57, 6):
            resource.setrlimit(resource.RLIMIT_AS, (mib << 20, hard))
            try:
                co = shared_td.Coordinator()
                co.start()
            except RuntimeError as e:
                assert "before listening" in str(e) and f"RLIMIT_AS of {mib} MiB" in str(e), e
                print("REFUSED", mib)
                continue
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            with co:
                try:
                    co.publish("x", shared_td.TensorDict(a=torch.zeros(4), batch_size=[4]))
                    print("SERVED", mib)
                except shared_td.CoordinatorTimeoutError as e:
                    assert f"its RLIMIT_AS is {mib} MiB" in str(e), e
                    print("SHORT", mib)
    """)
    assert "REFUSED 18" in out, out
