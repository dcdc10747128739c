"""Fork children made while another thread of the parent holds a shared_td lock or is
inside what it guards (fork20): the child must not wait for ever on it, nor keep it
from the parent. Each case runs in a script of its own (a real fork, bounded; the child
exits normally)."""
import os
import subprocess
import sys
import textwrap

import shared_td

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(shared_td.__file__)))  # (the package tested)


def _run(code: str, timeout: float = 60) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "PYTHONPATH": PACKAGE_ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


HOLD = """
import os, sys, threading, time, faulthandler, tempfile
import torch
from shared_td import TensorDict, NonTensorData
held, go = threading.Event(), threading.Event()
def hold(lock):
    with lock:
        held.set(); go.wait(30)
def fork_while_held(lock, work):
    t = threading.Thread(target=hold, args=(lock,), daemon=True); t.start(); held.wait(10)
    pid = os.fork()
    if pid == 0:
        faulthandler.dump_traceback_later(10, exit=True)  # a hang: exit 1
        work(); sys.exit(0)
    _, st = os.waitpid(pid, 0); go.set(); t.join(10)
    print("child", os.waitstatus_to_exitcode(st))
"""


def test_fork_child_memmap_while_a_parent_thread_locks_a_tree(tmp_path):
    out = _run(HOLD + f"""
from shared_td.containers import locking
fork_while_held(locking._tokens_guard,
                lambda: TensorDict(a=torch.zeros(2), batch_size=[]).memmap_({str(tmp_path / 'c')!r}))
""")
    assert "child 0" in out


def test_fork_child_deepcopy_while_a_parent_thread_saves_consolidated_values():
    out = _run(HOLD + """
import copy, types
from shared_td.containers import consolidated_extras
def work():
    td = TensorDict(a=torch.zeros(3), n={"b": torch.ones(2)}).consolidate().unlock_()
    td["h"] = NonTensorData(types.SimpleNamespace(node=td["n"]))
    assert copy.deepcopy(td)["h"].node is not None
fork_while_held(consolidated_extras._hook, work)
""")
    assert "child 0" in out


def test_fork_child_does_not_keep_the_node_flock_of_a_parents_rewrite(tmp_path):
    out = _run(f"""
import os, sys, threading, time
import torch
from shared_td import TensorDict, NonTensorData
from shared_td.persist import node_rewrite as NR
NR.NODE_LOCK_S = 2.0
mm = TensorDict(s=NonTensorData("m0"), batch_size=[]).memmap_({str(tmp_path / 'mm')!r}, share_non_tensor=True)
inside, go = threading.Event(), threading.Event()
real = NR._rewrite_in
def stopped(obj, opened):
    if threading.current_thread().name == "writer":
        inside.set(); go.wait(30)
    return real(obj, opened)
NR._rewrite_in = stopped
t = threading.Thread(target=mm.set_, args=("s", "thread"), name="writer"); t.start(); inside.wait(10)
pid = os.fork()
if pid == 0:
    time.sleep(5); os._exit(0)  # a child that lives on (a DataLoader worker)
try:
    go.set(); t.join()
    mm.set_("s", "parent")  # before: TimeoutError (the child's copy held the flock)
    print("value", mm["s"])
finally:
    os.kill(pid, 9); os.waitpid(pid, 0)
""")
    assert "value parent" in out
