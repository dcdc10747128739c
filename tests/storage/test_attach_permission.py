"""A segment whose sender's descriptors this process may not open (another user's
process; a ptrace restriction) is a SegmentUnavailableError that says so: before, it said
that the sender "has exited or no longer holds it", while the sender held it and lived.

The sender is made non-dumpable (as a setuid program is), so that opening its
``/proc/<pid>/fd`` takes CAP_SYS_PTRACE, which the receiver lacks: a fresh interpreter (a
fork child would find the segment in its copy of the cache) started without capabilities
by ``setpriv``.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import shutil
import subprocess
import sys
import textwrap

import pytest

from shared_td.storage.anonymous import Segment

_PR_SET_DUMPABLE = 4
_RECEIVER = textwrap.dedent("""
    import pickle, sys
    from shared_td.errors import SegmentUnavailableError
    try:
        pickle.loads(sys.stdin.buffer.read())
        print("attached")
    except SegmentUnavailableError as error:
        print(error)
""")


def _sender(ready_write: int, stop_read: int) -> None:  # runs in a fork child
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    segment = Segment.create(64)
    os.write(ready_write, pickle.dumps(segment))  # the /proc route: its pid and descriptor
    os.read(stop_read, 1)  # holds the segment until the receiver is done


def test_an_attach_refused_by_permissions_says_so_not_that_the_sender_is_gone():
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is needed to start a receiver without capabilities")
    ready_read, ready_write = os.pipe()
    stop_read, stop_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_read)
            os.close(stop_write)
            _sender(ready_write, stop_read)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_write)
    os.close(stop_read)
    try:
        data = os.read(ready_read, 65536)
        done = subprocess.run([setpriv, "--bounding-set=-all", "--inh-caps=-all", sys.executable, "-c", _RECEIVER],
                              input=data, capture_output=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    finally:
        os.close(stop_write)  # the sender exits
        os.close(ready_read)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    if done.returncode != 0 and b"setpriv" in done.stderr:
        pytest.skip(f"setpriv could not drop capabilities here: {done.stderr.decode()[:200]}")
    message = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    if message.strip() == "attached":
        pytest.skip("this kernel lets a process without capabilities open a non-dumpable one's descriptors")
    assert "may not open" in message and f"process {pid}" in message, message
    assert "has exited" not in message, message
