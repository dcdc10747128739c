"""The signed store, and two cluster members in one process (fast; no process trees).

Two Cluster objects of one process are two nodes as far as the store and gloo are
concerned (each its own ranks, threads and sockets), which keeps these checks to a
fraction of a second; test_cluster.py runs real node process trees.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

from tests.cluster.stores import loopback_store  # noqa: E402

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_replica  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore  # noqa: E402

KEY = b"in-process test key"  # (16 bytes at least: cluster_launch.MIN_KEY_BYTES)


@pytest.fixture
def store():
    return loopback_store(10)


def test_signed_values_round_trip_and_forgeries_are_refused(store):
    signed = SignedStore(store, KEY, timeout=5)
    signed.set_json("name/a", {"owner": 1})
    assert signed.get_json("name/a") == {"owner": 1}
    # another key, a changed byte, a value written without a signature, a moved value
    with pytest.raises(ClusterAuthError, match="'name/a'.*wrong signature"):
        SignedStore(store, b"wrong", timeout=5).get_json("name/a")
    raw = store.get("shared_td/name/a")
    store.set("shared_td/name/b", raw[:-1] + b"2")
    store.set("shared_td/name/c", b'{"owner": 0}')
    store.set("shared_td/name/d", raw)  # a valid signature of another key
    for key in ("name/b", "name/c", "name/d"):
        with pytest.raises(ClusterAuthError):
            signed.get_json(key)


def test_queue_values_are_signed(store):
    signed = SignedStore(store, KEY, timeout=5)
    signed.push_json("queue/0", {"op": "x"})
    assert signed.pop_json("queue/0", 1) == {"op": "x"}
    store.queue_push("shared_td/queue/0", b"\x80\x04forged pickle")
    with pytest.raises(ClusterAuthError):
        signed.pop_json("queue/0", 1)
    began = time.monotonic()
    assert signed.pop_json("queue/0", 0.2) is None  # bounded
    assert time.monotonic() - began < 2


class _SlowConnects:
    """The store, whose new connections take ``delay`` seconds: what torch's reverse DNS
    lookup of the peer does when the resolver drops a query (5 s, one connect in ~25 on
    the CI machine; the cause of a sync that overran its timeout)."""

    def __init__(self, store, delay: float):
        self.store, self.delay = store, delay

    def clone(self):
        time.sleep(self.delay)
        return self.store.clone()


def _first_call_in_a_new_thread(signed: SignedStore) -> float:
    took = []

    def call():
        began = time.monotonic()
        signed.set_json("name/x", {"owner": 0})
        took.append(time.monotonic() - began)

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    assert took, "the call did not end"
    return took[0]


def test_a_new_threads_first_call_takes_a_spare_connection_made_ahead(store):
    signed = SignedStore(store, KEY, timeout=10, spares=2)
    deadline = time.monotonic() + 10
    while signed._spares.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    signed._raw = _SlowConnects(store, 2.0)  # every connect from now on stalls
    assert _first_call_in_a_new_thread(signed) < 1.0  # a spare: no connect of its own
    assert _first_call_in_a_new_thread(signed) < 1.0
    # the spares are used up (their replacements still connecting): the next connects
    assert _first_call_in_a_new_thread(signed) >= 2.0
    signed.close()
    time.sleep(2.5)  # the replacements end, and go at once: closed
    assert signed._spares.qsize() == 0
    without = SignedStore(store, KEY, timeout=10)  # as before: each thread connects
    without._raw = _SlowConnects(store, 2.0)
    assert _first_call_in_a_new_thread(without) >= 2.0


def _spare_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "shared_td-store-spare"]


def test_close_returns_once_no_spare_is_still_connecting(store):
    # a daemon thread still inside torch's connect when the interpreter exits aborts the
    # process ("terminate called without an active exception", seen at the end of a test run)
    before = set(_spare_threads())
    signed = SignedStore(store, KEY, timeout=10)
    signed._raw = _SlowConnects(store, 1.0)  # every connect from now on stalls
    signed._connect_spares(3)
    began = time.monotonic()
    signed.close()
    assert 0.9 <= time.monotonic() - began < 5.0  # waited for the connects, bounded
    assert not set(_spare_threads()) - before
    assert signed._spares.qsize() == 0  # what they made went at once: closed
    assert all(not thread.daemon for thread in _spare_threads())


def test_counter_is_shared_between_stores(store):
    a = SignedStore(store, KEY, timeout=5)
    b = SignedStore(store.clone(), KEY, timeout=5)
    from shared_td.coordinator.cluster_counter import ClusterCounter

    ca, cb = ClusterCounter(a, "c"), ClusterCounter(b, "c")
    assert [ca.fetch_add(2), cb.fetch_add(1), ca.fetch_add()] == [0, 2, 3]
    assert cb.value == 4


def test_cluster_counter_refuses_what_the_local_counter_refuses(store):
    """1.5 added 1 and "2" added 2 (int()); past int64 the store wrapped round."""
    from shared_td.coordinator.cluster_counter import ClusterCounter

    counter = ClusterCounter(SignedStore(store, KEY, timeout=5), "checked")
    local = shared_td.SharedCounter(0)
    for wrong in (1.5, "2", True, None):
        for each in (counter, local):
            with pytest.raises(TypeError, match="n must be an int"):
                each.fetch_add(wrong)
    assert counter.value == 0
    assert counter.fetch_add(torch.tensor(3)) == 0 and counter.fetch_add(-1) == 3  # any integer
    top = 2**63 - 1
    assert counter.fetch_add(top - 2) == 2 and counter.value == top
    for each, old in ((counter, top), (local, 0)):
        with pytest.raises(OverflowError, match="int64"):
            each.fetch_add(2**64)
    with pytest.raises(OverflowError, match=f"on {top} leaves the int64 range"):
        counter.fetch_add(1)
    assert counter.value == top  # taken back
    assert counter.fetch_add(-top) == top and counter.value == 0


def _start_together(members) -> list:
    """Start every member in its own thread (each waits for the others); their errors."""
    errors = []

    def start(member):
        try:
            member.start()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            errors.append(err)

    threads = [threading.Thread(target=start, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return errors


def _pair(store, timeout=10.0):
    """Nodes 0 and 1 of a cluster on ``store``, started together (each waits for the other)."""
    return _members(store, (timeout, timeout))


def _members(store, timeouts):
    """Nodes 0..n-1 of a cluster on ``store``, node i with timeout ``timeouts[i]``, started
    together."""
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    members = [Cluster(url, n, len(timeouts), authkey=KEY, timeout=timeout, hostname="127.0.0.1")
               for n, timeout in enumerate(timeouts)]
    errors = _start_together(members)
    if errors:
        for member in members:
            member.shutdown()
        raise errors[0]
    return members


@pytest.fixture
def pair(store):
    members = _pair(store)
    yield members
    for member in members:
        member.shutdown()


def test_forged_request_is_dropped_and_the_node_keeps_serving(store, pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]))
    # a request pushed without the key: never acted on, counted
    store.queue_push("shared_td/queue/0", b"0" * 32 + b'{"op": "pull", "name": "p"}')
    store.queue_push("shared_td/lane/0/1", b"0" * 32 + b'{"op": "pull", "name": "p"}')  # node 1's lane
    replica = other.attach("p")
    assert replica["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert owner.refused == 2
    td["x"].add_(1)
    assert owner.sync("p").delivered == [1]
    assert replica["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
    # (the attach's pull was delivery 2: each sync and each pull takes the next version)
    assert cluster_replica.replica_version(replica) == 3 == other.version("p")


def test_republish_makes_replica_stale(pair):
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]))
    first = other.attach("p")
    assert not other.is_stale("p")
    owner.publish("p", shared_td.TensorDict(x=torch.ones(5), batch_size=[5]))
    # the view is stale at once (node 1's own replica may already be renewed by the
    # owner's notice, so other.is_stale("p") can read either way here)
    assert shared_td.is_stale(first)
    second = other.attach("p")  # a new replica of the new generation
    assert second["x"].tolist() == [1.0] * 5 and first["x"].tolist() == [0.0] * 3
    assert not other.is_stale("p") and not shared_td.is_stale(second) and shared_td.is_stale(first)


def test_unknown_and_unreplicable_names_are_clear_errors(pair, tmp_path):
    owner, other = pair
    with pytest.raises(KeyError, match="'nothing'"):
        other.attach("nothing")
    with pytest.raises(KeyError, match="does not own 'nothing'"):
        owner.sync("nothing")
    with pytest.raises(ValueError, match="'files'.*anonymous"):
        owner.publish("files", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]).memmap_(tmp_path))


def test_wait_version_is_bounded(pair):
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]))
    replica = other.attach("p")  # (its pull: version 2)
    assert cluster_replica.wait_version(replica, 1, timeout=1) == 2
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="version 3"):
        cluster_replica.wait_version(replica, 3, timeout=0.3)
    assert time.monotonic() - began < 2
    waiter = threading.Thread(target=owner.sync, args=("p",))
    waiter.start()
    assert cluster_replica.wait_version(replica, 3, timeout=10) == 3
    waiter.join(10)


def test_store_host_lost_gives_connection_error():
    store = loopback_store(10)
    owner, other = _pair(store)
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(3), batch_size=[3]))
        other.attach("p")
        del store  # the test hosts the store: stopping it is losing the store host
        import gc

        gc.collect()
        with pytest.raises(ConnectionError):
            other.pull("p")
    finally:
        owner.shutdown()
        other.shutdown()


def test_a_member_refused_at_start_shuts_down_cleanly(store):
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    members = [Cluster(url, 0, 2, authkey=KEY, timeout=10), Cluster(url, 1, 2, authkey=b"wrong key, 16 bytes+", timeout=10)]
    errors = _start_together(members)
    assert len(errors) == 2 and all(isinstance(e, ClusterAuthError) and "wrong signature" in str(e) for e in errors)
    for member in members:
        member.shutdown()  # nothing was started: nothing to stop, no error
        member.shutdown()


def test_env_launch_reads_rank_and_count_as_torchrun_sets_them(store, monkeypatch):
    from shared_td.coordinator.cluster_store import open_store

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_USE_AGENT_STORE": "True",  # join the agent's store, never host
                        "GROUP_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    _store, node, nodes = open_store("env://", None, 15.0)
    assert (node, nodes) == (1, 2)
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's second process: one Coordinator per node
    with pytest.raises(ValueError, match="LOCAL_RANK=1"):
        open_store("env://", None, 15.0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with Cluster("env://", authkey=KEY, timeout=15.0) as single:
        assert (single.node, single.nodes) == (0, 1)
        assert single.counter("c").fetch_add(5) == 0
    assert store.add("shared_td/counter/c", 0) == 5  # it used the store at MASTER_PORT


def test_cluster_urls_are_checked(monkeypatch):
    from shared_td.coordinator.cluster_store import open_store

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for url in ("udp://x:1", "tcp://nohost", "env://"):
        with pytest.raises(ValueError, match="cluster="):
            open_store(url, 0, 1.0)


def test_a_pair_moved_on_by_one_node_is_followed_by_the_other(pair):
    """Pair generations are cached: the node that fails a pair tells the other (a notice),
    and a request sent on the old generation before the notice came is refused without a
    transfer and retried (a pull), never left waiting for an answer."""
    import time

    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]))
    replica = other.attach("p")
    old = other._groups.generation(0)
    assert owner._groups.generation(1) == old
    owner._groups.fail(1, old)  # as after a failed transfer on the owner's side
    deadline = time.monotonic() + 5
    while other._groups.generation(0) == old:  # the notice reaches node 1's service thread
        assert time.monotonic() < deadline, "node 1 never heard of the new pair generation"
        time.sleep(0.01)
    replica["x"][1] = 7.0
    other.push("p", [1])
    assert td["x"].tolist() == [0.0, 7.0, 2.0, 3.0]
    # a request on a generation the owner already left (sent just before its notice came)
    owner._groups.fail(1, old + 1)
    other._groups._generations[0] = old + 1  # the notice not seen yet
    td["x"][3] = 9.0
    began = time.monotonic()
    other.pull("p")
    assert time.monotonic() - began < 2
    assert replica["x"].tolist() == [0.0, 7.0, 2.0, 9.0]
    assert other._groups.generation(0) == old + 2


def test_rebuilding_a_pair_takes_no_new_store_connection(pair, monkeypatch):
    """Each build of a pair's group runs in a new thread, whose first store call took a
    spare or connected itself; a connect can stall 5 s in a reverse DNS lookup (a pull
    that rebuilt the pair while every spare was still connecting took 5.0 s). The
    builds with one peer now share one connection: after the first, none is taken."""
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")  # the first build with the peer, on each node
    connected = []
    first_call = SignedStore._store

    def noting_connects(self):
        fresh = getattr(self._local, "store", None) is None
        store = first_call(self)
        if fresh:
            connected.append(threading.current_thread().name)
        return store

    monkeypatch.setattr(SignedStore, "_store", noting_connects)
    for generation in range(3):  # fail the pair, then a push builds the next generation
        owner._groups.fail(1, owner._groups.generation(1))
        until = time.monotonic() + 5
        while other._groups.generation(0) != owner._groups.generation(1):  # the notice
            assert time.monotonic() < until, "node 1 never heard of the new pair generation"
            time.sleep(0.01)
        replica["x"][generation] = 1.0 + generation
        other.push("p", [generation])
    assert td["x"].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert not [name for name in connected if name.startswith("shared_td-cluster-build")], connected


def test_push_takes_negative_rows_and_refuses_rows_out_of_range(pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), flag=torch.zeros(4, dtype=torch.uint8),
                                                 y=torch.zeros(4, 2, dtype=torch.float64), batch_size=[4]))
    replica = other.attach("p")
    replica["x"][3], replica["flag"][3], replica["y"][3] = 5.0, 1, torch.tensor([6.0, 7.0], dtype=torch.float64)
    other.push("p", [-1])  # the last row; y's rows come after an odd number of bytes
    assert td["x"].tolist() == [0.0, 0.0, 0.0, 5.0] and td["flag"].tolist() == [0, 0, 0, 1]
    assert td["y"][3].tolist() == [6.0, 7.0] and td["y"][:3].abs().sum() == 0
    with pytest.raises(IndexError, match="'p'.*out of range"):
        other.push("p", [4])
    with pytest.raises(IndexError, match="out of range"):
        other.push("p", [-5])
    assert td["x"].tolist() == [0.0, 0.0, 0.0, 5.0]


def test_push_rows_are_what_indexing_selects_masks_and_slices_included():
    """A boolean mask was taken as rows 0 and 1 (True/False as ints) and a float index was
    truncated: the wrong rows, silently. Checked against td[index] itself (no network)."""
    from shared_td.coordinator.cluster_push import _checked_index

    class Replica:
        layout = {"batch_size": [5]}

    td = shared_td.TensorDict(x=torch.arange(5), batch_size=[5])
    mask = torch.tensor([False, True, False, True, True])
    for index in (mask, mask.tolist(), mask.numpy(), slice(1, None, 2), slice(-2, None), slice(7, 9),
                  range(3), [4, -1, 0], torch.tensor([[3], [1]]), torch.tensor(2, dtype=torch.int16), -2, []):
        rows = _checked_index("r", Replica, index)
        assert rows.dtype == torch.int64 and rows.tolist() == td[index]["x"].reshape(-1).tolist(), index
    with pytest.raises(IndexError, match="'r'.*boolean mask.*5 values, not shape \\(4,\\)"):
        _checked_index("r", Replica, mask[:4])
    with pytest.raises(ValueError, match="'r'.*step"):
        _checked_index("r", Replica, slice(None, None, -1))
    with pytest.raises(TypeError, match="'r'.*torch.float32"):
        _checked_index("r", Replica, torch.tensor([1.7]))
    with pytest.raises(TypeError, match="'r'"):
        _checked_index("r", Replica, [0.0, 1.0])
    Replica.layout = {"batch_size": []}
    with pytest.raises(IndexError, match="'r' has no batch dimension"):
        _checked_index("r", Replica, 0)


def test_a_push_by_boolean_mask_writes_the_masked_rows(pair):
    owner, other = pair
    td = owner.publish("m", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("m")
    replica["x"].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    other.push("m", torch.tensor([False, True, False, True]))
    assert td["x"].tolist() == [0.0, 2.0, 0.0, 4.0]
    other.push("m", slice(0, 1))
    assert td["x"].tolist() == [1.0, 2.0, 0.0, 4.0]


class _Heartbeats:
    """The heartbeats of nodes as the store holds them, for a Liveness without a store:
    ``beats[node]`` is written as its stored bytes, and those of the nodes in ``forged``
    fail the signature check."""

    def __init__(self, beats: dict, forged=()):
        self.beats, self.forged = beats, set(forged)

    def get_unchecked(self, key: str) -> bytes:
        return str(self.beats[int(key.split("/")[1])]).encode()

    def check(self, key: str, blob: bytes) -> bytes:
        if int(key.split("/")[1]) in self.forged:
            raise ClusterAuthError(f"{key} forged")
        return blob


def test_a_quiet_node_that_beats_again_is_not_counted_lost(monkeypatch):
    """A node whose heartbeat stood still past LOST_AFTER_S (stopped, then SIGCONT) is
    given one more look before a sync drops it: the race that made a resumed replica
    node be dropped by the first sync after it ran again."""
    from shared_td.coordinator import cluster_liveness

    monkeypatch.setattr(cluster_liveness, "LOST_AFTER_S", 0.2)
    beats = {1: 1, 2: 1}
    liveness = cluster_liveness.Liveness(_Heartbeats(beats), 0, read=None)
    assert liveness.alive(1) and liveness.alive(2)  # first look
    time.sleep(0.3)  # both quiet for longer than LOST_AFTER_S
    assert not liveness.alive(1) and not liveness.alive(2)
    resumer = threading.Timer(0.2, lambda: beats.__setitem__(1, 2))  # node 1 runs again
    resumer.start()
    began = time.monotonic()
    try:
        assert liveness.still_lost([1, 2], wait=1.0) == [2]
    finally:
        resumer.join(5)
    assert time.monotonic() - began < 1.0 + 0.5  # bounded by the wait
    assert liveness.still_lost([2], wait=0.0) == [2]  # no wait: the answer at once


def test_a_node_found_lost_is_not_waited_for_again_until_it_beats(monkeypatch):
    """Each sync after a replica node died waited the whole extra look (1 s) for it again:
    40 syncs back to back took 40 s. Found lost once, it is lost at once while its
    heartbeat stands still, and waited for again after it moved."""
    from shared_td.coordinator import cluster_liveness

    monkeypatch.setattr(cluster_liveness, "LOST_AFTER_S", 0.2)
    beats = {1: 1, 2: 1}
    refused = []
    # node 2's heartbeat has a wrong signature: counted once, and lost as it stands still
    liveness = cluster_liveness.Liveness(_Heartbeats(beats, forged=[2]), 0, read=None,
                                         refuse=lambda: refused.append(1))
    assert liveness.alive(1) and liveness.alive(2)
    time.sleep(0.3)
    assert liveness.still_lost([1, 2], wait=0.3) == [1, 2]  # the first time: one more look
    began = time.monotonic()
    for _ in range(5):
        assert liveness.still_lost([1, 2], wait=1.0) == [1, 2]
    assert time.monotonic() - began < 0.5  # not 5 x 1 s
    beats[1] = 2  # node 1 runs again, then stops for good
    assert liveness.alive(1)
    time.sleep(0.3)
    began = time.monotonic()
    assert liveness.still_lost([1], wait=0.3) == [1]
    assert time.monotonic() - began >= 0.3  # its new silence gets the look again
    assert len(refused) == 1  # node 2's one forged value, however often it was read


def test_once_the_store_host_is_lost_no_new_connection_is_tried():
    """A connect to a store host that is gone does not fail at once: torch retries the
    refused connect until its timeout, then once more after a random backoff (7-14 s
    measured for a spare's 7 s bound), and a node cannot exit while one runs (a CI run's
    node took 16 s to stop after the host's SIGKILL). Once a call found the host gone, a
    thread's first call fails at once and no spare is connected any more."""
    import datetime
    import gc

    host = loopback_store(10)
    client = torch_dist.TCPStore("127.0.0.1", host.port, None, False, datetime.timedelta(seconds=10))
    signed = SignedStore(client, KEY, timeout=10.0, spares=2)
    deadline = time.monotonic() + 30
    while signed._spares.qsize() < 2 or signed._connecting:  # bounded: the spares connect
        assert time.monotonic() < deadline
        time.sleep(0.01)
    signed.set_json("x", 1)  # this thread's connection: a spare (its replacement connects)
    while signed._connecting:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    del host
    gc.collect()  # the host is gone
    with pytest.raises(ConnectionError):
        signed.get_json("x")
    outcomes = []

    def first_call() -> None:
        began = time.monotonic()
        try:
            signed.get_json("x")
            outcomes.append(("no error", time.monotonic() - began))
        except Exception as err:  # noqa: BLE001 - recorded for the assertion
            outcomes.append((type(err).__name__, time.monotonic() - began))

    for _ in range(3):  # two take the spares connected before the loss, the third has none
        thread = threading.Thread(target=first_call)
        thread.start()
        thread.join(40)
        assert not thread.is_alive()
    assert [name for name, _took in outcomes] == ["ConnectionError"] * 3, outcomes
    assert all(took < 1.0 for _name, took in outcomes), outcomes
    assert not signed._connecting  # no spare is being connected to the lost host
    began = time.monotonic()
    signed.close()
    assert time.monotonic() - began < 1.0


def test_a_spare_connecting_when_the_host_dies_ends_soon_and_close_waits_only_for_it():
    """A spare's connect that runs while the store's host dies (it had stalled in the
    resolver, or began before any call noticed the loss) keeps retrying the refused
    connect: torch retries it until the connect's timeout, then once more after a random
    backoff of up to that timeout. The node's close, and its process's exit, wait for
    that thread (a daemon would abort the process at exit), so the whole connect must fit
    a node's stop: a CI run's node took 9.6 s to stop when a spare's 7 s bound was
    really 7 + 7 s."""
    import datetime
    import gc

    host = loopback_store(10)
    client = torch_dist.TCPStore("127.0.0.1", host.port, None, False, datetime.timedelta(seconds=10))
    signed = SignedStore(client, KEY, timeout=10.0)
    signed.set_json("x", 1)  # connected while the host is up
    del host
    gc.collect()  # the host is gone; no call of this store has noticed
    before = set(_spare_threads())
    began = time.monotonic()
    signed._connect_spares(1)  # a replacement, as a thread that took a spare makes
    time.sleep(0.5)
    signed.close()
    assert not set(_spare_threads()) - before  # close waited for it ...
    took = time.monotonic() - began
    assert took < 6.0, took  # ... and the connect ended within a stop's bound
    assert signed._spares.qsize() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tree_is_published_and_replicated_through_cpu_shared_memory(pair):
    """Replicas are CPU segments: a tree on the GPU is copied to the owner's segment when
    it is published, and travels over gloo from there (NCCL would need a GPU per node)."""
    owner, other = pair
    td = shared_td.TensorDict(x=torch.arange(4.0, device="cuda"), nested={"y": torch.ones(4, 2, device="cuda")},
                              batch_size=[4], device="cuda")
    published = owner.publish("p", td)
    assert published["x"].device == torch.device("cpu") and torch.equal(published["x"], td["x"].cpu())
    replica = other.attach("p")
    assert replica["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and replica["nested", "y"].sum() == 8
    published["x"].add_(1)
    assert owner.sync("p").delivered == [1]
    assert replica["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
    replica["nested", "y"][2] = 5.0
    other.push("p", [2])
    assert published["nested", "y"][2].tolist() == [5.0, 5.0]
