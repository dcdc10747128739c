"""SIGKILL of an owner node in the middle of another node's calls, for the cluster tests
(a helper module, not a test)."""
from __future__ import annotations

import os
import random
import shutil
import signal
import tempfile
import time

from tests.processes import WAIT

__all__ = ["loop_through_an_owner_kill"]


def loop_through_an_owner_kill(nodes, command: tuple, within: float = 10.0, pause=(0.2, 1.0)) -> tuple:
    """Node 2 runs ``command`` (a loop of cluster_children that calls until an error and
    answers its count, the error's class and the CLOCK_MONOTONIC time it ended, first)
    while its owner, node 1, is SIGKILLed a random pause after the loop's first call
    came back: checks the loop ended in OwnerLostError within ``within`` seconds of the
    kill. Returns the loop's answer."""
    started = os.path.join(tempfile.mkdtemp(prefix="shared_td-loop-"), "started")
    try:
        nodes.commands[2].put((*command, started))
        deadline = time.monotonic() + WAIT
        while not os.path.exists(started):  # bounded: the loop's answer says why it ended
            if time.monotonic() > deadline or not nodes.results[2].empty():
                raise AssertionError(f"the loop made no call: {nodes.results[2].get(timeout=WAIT)}")
            time.sleep(0.01)
    finally:
        shutil.rmtree(os.path.dirname(started), ignore_errors=True)
    time.sleep(random.uniform(*pause))
    os.kill(nodes.procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
    answer = nodes.results[2].get(timeout=WAIT)
    assert answer[0] == "ok", answer
    count, error, ended = answer[1][:3]
    assert count > 0 and error == "OwnerLostError", answer
    assert ended - killed < within, answer
    return answer[1]
