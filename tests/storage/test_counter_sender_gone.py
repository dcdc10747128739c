"""A SharedCounter unpickled after the process that sent it exited: the error says it is
a SharedCounter, that its sender is gone, and what to do (not a generic segment
message). Real spawned and forked senders that exit."""
from __future__ import annotations

import multiprocessing
import pickle

import pytest

from shared_td import SharedCounter
from shared_td.errors import SegmentUnavailableError
from tests.processes import WAIT, finish


def _send_a_counter(conn, wait_for_ack: bool) -> None:
    counter = SharedCounter(5)
    conn.send_bytes(pickle.dumps(counter))
    if wait_for_ack and conn.poll(WAIT):
        conn.recv_bytes()
    conn.close()


def _receive(method: str, wait_for_ack: bool):
    """Start a sender with ``method``; return (its pid, the pickled counter, the parent's
    end of the pipe, the process)."""
    context = multiprocessing.get_context(method)
    ours, theirs = context.Pipe()
    sender = context.Process(target=_send_a_counter, args=(theirs, wait_for_ack))
    sender.start()
    theirs.close()
    assert ours.poll(WAIT), "the sender sent nothing"
    return sender.pid, ours.recv_bytes(), ours, sender


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_counter_whose_sender_exited_says_what_happened_and_the_fix(method):
    pid, sent, conn, sender = _receive(method, wait_for_ack=False)
    assert finish(sender) == 0
    sender.close()  # its sentinel descriptor, now, not when collected
    conn.close()
    with pytest.raises(SegmentUnavailableError) as caught:
        pickle.loads(sent)
    message = str(caught.value)
    assert message.startswith("The SharedCounter (8 bytes of anonymous shared memory)")
    assert f"sent by process {pid} is gone" in message and "has exited" in message
    assert "keep the sender alive until every receiver has unpickled it" in message
    assert "tensors memory-mapped without a prefix" not in message  # the generic advice


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_counter_unpickled_before_its_sender_exited_keeps_working(method):
    pid, sent, conn, sender = _receive(method, wait_for_ack=True)
    counter = pickle.loads(sent)  # while the sender still holds it
    conn.send_bytes(b"ack")
    assert finish(sender) == 0
    sender.close()  # its sentinel descriptor, now, not when collected
    conn.close()
    assert counter.fetch_add(2) == 5 and counter.value == 7
    # sent on by this process, it attaches while this process holds it
    assert pickle.loads(pickle.dumps(counter)) is counter


def test_a_counter_released_in_this_process_says_so():
    sent = pickle.dumps(SharedCounter(1))  # the counter dies here: nothing holds it
    with pytest.raises(SegmentUnavailableError, match=r"SharedCounter .*released in this process.*keep the sender alive"):
        pickle.loads(sent)
