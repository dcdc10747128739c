"""Fork hooks (review50): a fork from a signal handler inside resolving() must not hang;
a parent thread's consolidated-extras context closed in a fork child must not unbalance
the child's count of open contexts (each case a script of its own, bounded)."""
import subprocess
import sys
import textwrap

_SIGFORK = textwrap.dedent("""
    import os, signal, sys
    from shared_td.coordinator import cluster_store_watch as w
    def handler(sig, frame):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    signal.signal(signal.SIGUSR1, handler)
    # the window of a signal arriving inside resolving().__enter__'s `with _no_new_lookups:`
    with w._no_new_lookups:
        os.kill(os.getpid(), signal.SIGUSR1)
        _ = 1  # (the handler runs here)
    print("ok")
""")


def test_fork_from_a_signal_handler_inside_resolving_does_not_hang():
    try:
        done = subprocess.run([sys.executable, "-c", _SIGFORK], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the fork from the signal handler hung in cluster_store_watch._before_fork")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_EXTRAS = textwrap.dedent("""
    import copyreg, os, signal, threading, torch
    from shared_td.containers import consolidated_extras as ce
    ctx = ce.Context.__new__(ce.Context)
    opened, go = threading.Event(), threading.Event()
    def other():
        ce._open(ctx); opened.set(); go.wait(10); ce._close(ctx)
    t = threading.Thread(target=other); t.start(); opened.wait(5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        ce._close(ctx)
        users = ce._users
        mine = ce.Context.__new__(ce.Context); ce._open(mine)
        registered = copyreg.dispatch_table.get(torch.Tensor) is ce._reduce_tensor
        ce._close(mine)
        gone = torch.Tensor not in copyreg.dispatch_table or copyreg.dispatch_table[torch.Tensor] is not ce._reduce_tensor
        os.write(w, f"{users} {registered} {gone}".encode()); os._exit(0)
    os.close(w); go.set(); t.join(); os.waitpid(pid, 0)
    print(os.read(r, 1000).decode())
""")


def test_a_parent_threads_extras_context_closed_in_a_fork_child_keeps_the_count():
    done = subprocess.run([sys.executable, "-c", _EXTRAS], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0 True True", done.stdout  # before the fix: "-1 False True"
