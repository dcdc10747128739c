"""What the sixteenth audit of the cluster found about renewed replicas and restarts: a
push while this node renewed its replica sent the new replica's rows before any byte of
it came (zeros nobody wrote, into the owner's new data); after the renew, a push sent
the owner's own new values in place of the rows the user wrote into the old view, and
succeeded; and an attach of a name owned by this node's previous process waited out the
whole timeout. Two cluster members of one process, on a loopback store; every wait
bounded. (No tensordict counterpart: tensordict has no cluster.)"""
from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures: two members of this process
from tests.processes import wait_until  # noqa: E402

N, WIDTH = 8, 3  # 96 bytes of data, a segment of 128: no other receive of the pair has that size


def _buffer(value: float):
    return shared_td.TensorDict(w=torch.full((N, WIDTH), value), batch_size=[N])


def _held_transfer(member, monkeypatch):
    """Hold the next transfer that one of ``member``'s own threads (a lane: a renew's
    fill, a sync) receives into a replica: returns (started, release) events."""
    recv = member._groups.recv
    started, release = threading.Event(), threading.Event()

    def held(peer, generation, tensor, *args, **kwargs):
        if tensor.numel() == 128 and threading.current_thread() in member._threads and not started.is_set():
            started.set()
            release.wait(10)
        return recv(peer, generation, tensor, *args, **kwargs)

    monkeypatch.setattr(member._groups, "recv", held)
    return started, release


def failing_renews(member, error: BaseException, made: list | None = None):
    """Make the renews of ``member`` (the fills its own threads make, not the user's)
    raise ``error``; ``made`` gets a weakref to each new generation's tensordict. Returns
    the real fill, to put back (``member._fill = real``)."""
    real_fill = member._fill

    def failing_fill(name, rep):
        if member._serving():
            if made is not None:
                made.append(weakref.ref(rep.td))  # (on the new generation's segment)
            raise error
        return real_fill(name, rep)

    member._fill = failing_fill
    return real_fill


def _renewed(member, generation: int) -> bool:
    rep = member._replicas.get("buf")
    return rep is not None and rep.generation == generation and member.version("buf") is not None


def test_a_push_while_the_replica_is_renewed_never_sends_its_unfilled_rows(pair, monkeypatch):
    """The new replica was registered before its transfer: a push then read its zeros
    (state word 0 or odd), sent them as the new generation, and the owner wrote 0.0 into
    rows where it had published 5.0. Now the replica is registered once filled, and a
    push meanwhile is of the old replica, refused as published again."""
    owner, other = pair
    owner.publish("buf", _buffer(1.0))
    view = other.attach("buf")
    view["w"][N - 1] = 7.0  # the user's row, in the view of generation 1
    started, release = _held_transfer(other, monkeypatch)
    new = owner.publish("buf", _buffer(5.0))
    try:
        assert started.wait(10), "the renew's transfer did not start"
        with pytest.raises(RuntimeError, match=r"push\('buf'\): 'buf' was published again \(generation 2\) and this "
                                               r"node's replica is still of generation 1 .*Refresh the views"):
            other.push("buf", [N - 1])
    finally:
        release.set()
    assert wait_until(lambda: _renewed(other, 2), 10)
    assert torch.equal(new["w"], torch.full((N, WIDTH), 5.0))  # no zeros, nothing of the old view
    assert torch.equal(other.attach("buf")["w"], torch.full((N, WIDTH), 5.0))
    assert other.renew_failures == 0


def test_a_push_after_a_renew_refuses_to_send_the_owners_own_values_until_attach(pair):
    """After the renew, a push read the new replica, not the old view the user wrote
    into: the owner's own values went back in place of the user's rows, and the push
    succeeded. Now it is refused until this process attaches the new generation."""
    owner, other = pair
    owner.publish("buf", _buffer(1.0))
    view = other.attach("buf")
    new = owner.publish("buf", _buffer(5.0))
    assert wait_until(lambda: _renewed(other, 2), 10)
    view["w"][0] = 7.0  # written into the stale view
    with pytest.raises(RuntimeError, match=r"push\('buf'\): 'buf' was published again \(generation 2\) and this "
                                           r"node renewed its replica .*views of generation 1.*nothing was sent"):
        other.push("buf", [0])
    newest = owner.publish("buf", _buffer(6.0))  # renewed again: the user's rows are still in generation 1
    assert wait_until(lambda: _renewed(other, 3), 10)
    with pytest.raises(RuntimeError, match=r"published again \(generation 3\).*views of generation 1 "):
        other.push("buf", [0])
    assert shared_td.is_stale(view)
    view = shared_td.refresh(view)  # the user's attach of the new generation: pushes go again
    view["w"][0] = 9.0
    other.push("buf", [0])
    assert newest["w"][0].tolist() == [9.0] * WIDTH and newest["w"][1:].eq(6.0).all()
    assert new["w"].eq(5.0).all()


def test_a_push_waits_for_a_sync_that_writes_the_replica(pair, monkeypatch):
    """A push read the replica's rows while a sync wrote them (rows of two versions);
    now it waits for the transfer (bounded) and sends the rows after it."""
    owner, other = pair
    td = owner.publish("buf", _buffer(1.0))
    other.attach("buf")
    started, release = _held_transfer(other, monkeypatch)
    td["w"].fill_(2.0)
    syncing = threading.Thread(target=owner.sync, args=("buf",))
    syncing.start()
    pushed = []
    pusher = threading.Thread(target=lambda: pushed.append(other.push("buf", [0])))
    try:
        assert started.wait(10), "the sync's transfer did not start"
        pusher.start()
        time.sleep(0.2)
        assert not pushed, "the push did not wait for the sync writing the replica"
    finally:
        release.set()
        syncing.join(10)
        pusher.join(10)
    assert pushed == [None] and other.version("buf") == 3  # (the attach's pull was 2)
    assert td["w"].eq(2.0).all()


def test_attach_of_a_name_owned_by_this_nodes_previous_process_says_so_at_once(store, pair):
    """Node 0 published "p" and left; its next process's attach("p") sent a pull to its
    own lane, which no thread serves: TimeoutError after the whole timeout, a has/p/0
    record and the request left in the store. Now a KeyError at once, nothing left."""
    previous, _other = pair
    previous.publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]))
    previous.shutdown()
    restarted = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 0, 2, authkey=KEY, timeout=3.0,
                        hostname="127.0.0.1")
    signed = SignedStore(store, KEY, timeout=5.0)
    try:
        restarted.start()
        began = time.monotonic()
        with pytest.raises(KeyError, match=r"'p' is owned by this node \(node 0\), but by its previous process.*"
                                           r"Publish it again on this node"):
            restarted.attach("p")
        assert time.monotonic() - began < 1.0
        assert not signed.has("has/p/0")
        assert store.queue_len("shared_td/lane/0/0") == 0
        assert not restarted.replicates("p")
    finally:
        restarted.shutdown()
        signed.close()


def test_a_failed_renew_puts_the_replica_record_back_to_the_generation_held(pair):
    """The renew wrote has/ for the new generation before its fill, which failed: the
    record stayed, and every later sync of that generation came to this node, was
    refused unreceived (over 1 MiB) and failed the pair, each time."""
    owner, other = pair
    big = lambda value: shared_td.TensorDict(w=torch.full((512, 1024), value), batch_size=[512])  # 2 MiB
    owner.publish("buf", big(1.0))
    other.attach("buf")
    failing_renews(other, ConnectionError("the renew's transfer failed"))
    owner.publish("buf", big(5.0))
    assert wait_until(lambda: other.renew_failures == 1, 10)
    assert other._replicas["buf"].generation == 1
    assert owner._store.get_json("has/buf/1")["generation"] == 1
    pairs = owner._groups.generation(1)
    for _ in range(3):  # the replica holds an older generation: not sent to, no pair failed
        assert owner.sync("buf").delivered == []
    assert owner._groups.generation(1) == pairs


def test_a_renew_notice_during_a_first_attach_renews_it_once_done(pair):
    """The owner published again while this node's first attach was between its fill and
    its registration: the notice found no replica and was dropped, and the node held
    generation 1 for good (its processes never saw generation 2)."""
    owner, other = pair
    owner.publish("buf", _buffer(1.0))
    filled, release = threading.Event(), threading.Event()
    real = other._memmap_here

    def held(name, td, has_values):  # the fill is done; its registration waits
        filled.set()
        release.wait(10)
        return real(name, td, has_values)

    other._memmap_here = held
    out = {}
    first = threading.Thread(target=lambda: out.setdefault("td", other.attach("buf")))
    first.start()
    try:
        assert filled.wait(10)
        owner.publish("buf", _buffer(5.0))  # generation 2: a renew notice to node 1
        assert wait_until(lambda: other._announced.get("buf") == 2, 10)
    finally:
        release.set()
        first.join(10)
    assert wait_until(lambda: other._replicas["buf"].generation == 2, 10), other.renew_failures
    assert (other.attach("buf")["w"] == 5.0).all()


def test_a_pull_after_a_failed_renew_says_why_it_failed_not_that_it_is_being_renewed(pair):
    """limits21: a renew refused by a limit of this node (out of descriptors) was counted
    in renew_failures only, and every pull of the name then said the replica "is being
    renewed" while nothing renewed it. Now the refusal names the renew's error and that
    attach renews it; an attach does."""
    owner, other = pair
    owner.publish("buf", _buffer(1.0))
    other.attach("buf")
    real_fill = failing_renews(other, OSError(24, "Too many open files (RLIMIT_NOFILE soft/hard = 64/64)"))
    owner.publish("buf", _buffer(5.0))
    assert wait_until(lambda: other.renew_failures == 1, 10)
    other._fill = real_fill
    with pytest.raises(RuntimeError, match=r"still of generation 1 \(its renew failed: OSError: .*RLIMIT_NOFILE.*; "
                                           r"attach\('buf'\) renews it\)"):
        other.pull("buf")
    assert torch.equal(other.attach("buf")["w"], torch.full((N, WIDTH), 5.0))
    other.pull("buf")  # renewed: no refusal, whatever the failure kept
