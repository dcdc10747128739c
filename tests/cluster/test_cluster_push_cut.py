"""A pusher that dies in the middle of a push's message: the owner's thread that keeps a
receive posted for that peer's pushes ends within the loss detection and a transfer's
bound, and nothing of the cut push is written.

gloo never ends a receive whose message was cut by the sender's death (see
cluster_waits). The owner kept a receive posted for header and rows in one message of
the last push's size, and waited for it in the listening thread, which cannot watch the
peer's heartbeat: a 50 MB push cut by a SIGKILL left that thread waiting LISTEN_S (a
day). Rows over DIRECT_MAX_BYTES now come as a second message, waited for as any
transfer (given up once the pusher is found lost); the kept receive is never larger
than a message that is written whole as it is posted.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("torch.distributed")

from tests.cluster.test_cluster import nodes_of, store  # noqa: E402,F401  (the fixtures)
from tests.processes import WAIT, all_threads_stopped, wait_until  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: make_td: 28 bytes a row and 8 of index, so a push of every row is 50 MB: more than
#: loopback's socket buffers hold (tcp_wmem 4 MB + tcp_rmem up to 32 MB here) while the
#: owner does not read, so the message is surely cut when the pusher dies.
ROWS = 1_400_000
#: The bound: LOST_AFTER_S (3 s) for the heartbeat to stand still, a beat and a look,
#: then the pair's close; slack for a loaded 2-core machine.
WITHIN_S = 20.0


def test_a_pusher_killed_mid_message_ends_the_owners_kept_receive(nodes_of):  # noqa: F811
    nodes = nodes_of(2)
    nodes.ok(0, "publish", "big", ROWS, 0.0, timeout=90)
    nodes.ok(1, "attach", "big", timeout=90)
    nodes.ok(1, "push", "big", slice(0, ROWS), 1.0, timeout=90)  # the owner now keeps a receive posted
    assert len(nodes.ok(0, "push_listeners")) == 1
    owner = nodes.procs[0].pid
    os.kill(owner, signal.SIGSTOP)  # reads nothing: the next push's bytes fill the socket buffers, no more
    try:
        assert wait_until(lambda: all_threads_stopped(owner), timeout=5)  # (kill returns before it stops)
        nodes.commands[1].put(("push_cut", "big", ROWS, 0.5))  # the same size again, killed 0.5 s into its send
        nodes.procs[1].join(WAIT)
    finally:
        os.kill(owner, signal.SIGCONT)
    assert nodes.procs[1].exitcode == -signal.SIGKILL
    killed = time.monotonic()
    while (listening := nodes.ok(0, "push_listeners")) and time.monotonic() - killed < WITHIN_S:
        time.sleep(0.2)
    assert listening == [], f"still waiting {time.monotonic() - killed:.1f} s after the pusher died: {listening}"
    assert nodes.ok(0, "unique_w", "big") == [1.0]  # the cut push wrote nothing
