"""The cluster audit of session 18: publishes of one name at once, the unsigned keys that
drove decisions (generation and value counters, claims), a replica node's Cluster kept
for good after shutdown, unpublish of a cluster-held name, and a uint8 push index.

The attacks write the raw keys with a plain TCPStore client, as anything that reaches
the store's port can: each must be refused or harmless.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import threading
import time
import weakref

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from tests.cluster.stores import loopback_store  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _pair, _start_together, pair, store  # noqa: E402,F401 - fixtures
from tests.processes import wait_until  # noqa: E402


def _attacker(store):
    """A plain TCPStore client of the test's store: no key, raw bytes."""
    return torch_dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=5))


# ---------------------------------------------------------------- finding 2
def test_two_publishes_of_one_name_at_once_leave_the_record_and_the_owner_agreeing(store, pair):
    """Two threads of the owner re-published one name at once: the record named a
    generation the owner no longer held, every attach elsewhere failed and every sync
    reached nobody. The first publish is held inside (its values stored) while the
    second one comes: the second now waits for it."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    real, inside = owner._values.publish, threading.Event()

    def slow_first(*args):
        if not inside.is_set():
            inside.set()
            time.sleep(0.3)  # the other publish runs meanwhile (before: to its end)
        return real(*args)

    owner._values.publish = slow_first
    errors = []

    def publish(value: int):
        try:
            owner.publish("p", shared_td.TensorDict(x=torch.full((4 + value,), float(value)), batch_size=[4 + value]))
        except Exception as err:  # noqa: BLE001 - handed to the test
            errors.append(err)

    first = threading.Thread(target=publish, args=(1,))
    first.start()
    assert inside.wait(5)
    second = threading.Thread(target=publish, args=(2,))
    second.start()
    for thread in (first, second):
        thread.join(20)
    assert not errors and not first.is_alive() and not second.is_alive()
    record = owner._store.get_json("name/p")
    held = owner._owned["p"]
    assert record["generation"] == held.generation == 3  # (before: the record said 2)
    assert record.get("digest") == held.digest
    assert owner.attach("p")["x"].tolist() == [2.0] * 6  # the later publish, everywhere
    view = other.attach("p")
    assert view["x"].tolist() == [2.0] * 6 and not other.is_stale("p")
    held.td["x"].fill_(7.0)
    assert owner.sync("p", timeout=5).delivered == [1]
    assert view["x"].tolist() == [7.0] * 6


# ---------------------------------------------------------------- finding 1
def test_a_rewound_generation_counter_never_gives_a_number_a_signed_record_had(store, pair):
    """The counter generation/<name> set back to 0 made the next publish reuse the
    generation node 1 held, with another layout: node 1 read int32 bits as floats, and
    its push of x rows was written into the owner's y."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(4, dtype=torch.float32), batch_size=[4]))
    old = other.attach("p")
    _attacker(store).set("shared_td/generation/p", b"0")
    td = owner.publish("p", shared_td.TensorDict(y=torch.zeros(4, dtype=torch.int32), batch_size=[4]))
    assert owner.generation("p") == 2
    assert wait_until(lambda: other._replicas["p"].generation == 2, 10)  # renewed on the notice
    view = other.attach("p")
    assert list(view.keys()) == ["y"] and shared_td.is_stale(old)
    td["y"].copy_(torch.tensor([7, 8, 9, 10], dtype=torch.int32))
    assert owner.sync("p", timeout=5).delivered == [1]
    assert view["y"].tolist() == [7, 8, 9, 10] and old["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    old["x"].copy_(torch.tensor([1.5, 2.5, 3.5, 4.5]))
    other.push("p", [0, 1])  # rows of the replica this process was given: y, never the old x bits
    assert td["y"].tolist() == [7, 8, 9, 10]


def test_a_reused_generation_number_of_another_publish_is_refused_by_its_digest(store, pair):
    """Even a number reused (the counter set back and the name's record deleted, its
    owner restarted) is never taken for the generation a replica holds: the digest of
    the publish differs, so the replica is stale, and no sync, pull or push mixes the
    two layouts, nor does a value written on either side reach the other."""
    from shared_td.coordinator.cluster_values import decode

    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(4, dtype=torch.float32), task="old", batch_size=[4]),
                  share_non_tensor=True)
    old = other.attach("p")
    owner.shutdown()
    attacker = _attacker(store)
    attacker.set("shared_td/generation/p", b"0")
    attacker.delete_key("shared_td/name/p")
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    restarted = Cluster(url, 0, 2, authkey=KEY, timeout=5, hostname="127.0.0.1")
    try:
        restarted.start()
        td = restarted.publish("p", shared_td.TensorDict(y=torch.full((4,), 7, dtype=torch.int32), task="new",
                                                         batch_size=[4]), share_non_tensor=True)
        assert restarted.generation("p") == 1 == other._replicas["p"].generation  # the number is the old one
        assert other.is_stale("p") and shared_td.is_stale(old)
        assert restarted.sync("p", timeout=5).delivered == []  # node 1's record is of the other publish
        with pytest.raises(RuntimeError, match="refused.*no generation 1"):
            other.pull("p")
        with pytest.raises(RuntimeError):
            other.push("p", [0, 1])
        assert old["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and td["y"].tolist() == [7] * 4
        # values: the old replica's write stays its own, the new owner's never reaches it
        published = restarted._values.published
        old.set_("task", "stale write")
        td.set_("task", "owner write")
        assert wait_until(lambda: restarted._values.published > published, 5)
        time.sleep(0.2)  # (node 1's poller and service thread: every 1 ms)
        assert decode(restarted._store.get_json("value/p/1/0")["payload"]) == "owner write"
        assert old["task"] == "stale write"
        view = shared_td.refresh(old)
        assert sorted(view.keys()) == ["task", "y"] and view["y"].tolist() == [7] * 4
        assert view["task"] == "owner write"
    finally:
        restarted.shutdown()


def _cfg(task: str):
    return shared_td.TensorDict(w=torch.zeros(4), task=task, batch_size=[4])


def test_value_versions_come_from_the_signed_record_not_a_counter(store, pair):
    """valver/<name>/<g>/<i> set back to 0 made every later write of the owner be
    dropped by node 1 as old. The versions now come from the signed value record (by
    compare-and-set): a rewound counter is not read, and a replayed older record does
    not set the versions back either."""
    owner, other = pair
    mine = owner.publish("cfg", _cfg("start"), share_non_tensor=True)
    theirs = other.attach("cfg")
    attacker = _attacker(store)
    for i in range(3):
        mine.set_("task", f"v{i}")
        assert wait_until(lambda i=i: theirs["task"] == f"v{i}", 5)
    early = attacker.get("shared_td/value/cfg/1/0")  # a signed record, recorded
    mine.set_("task", "v3")
    assert wait_until(lambda: theirs["task"] == "v3", 5)
    attacker.set("shared_td/valver/cfg/1/0", b"0")  # the old counter: nothing reads it
    attacker.set("shared_td/value/cfg/1/0", early)  # a replay of an older version
    mine.set_("task", "new-on-owner")
    assert wait_until(lambda: theirs["task"] == "new-on-owner", 5), theirs["task"]
    theirs.set_("task", "new-on-node1")
    assert wait_until(lambda: mine["task"] == "new-on-node1", 5), mine["task"]
    assert other.attach("cfg")["task"] == "new-on-node1"


@pytest.mark.parametrize("forged", [b"forged", b""])
def test_a_forged_claim_is_refused_and_never_taken_for_a_takeover(store, pair, forged):
    """claim/1 overwritten (with other bytes, or emptied as a clean shutdown does) cut
    node 1 out of every sync, silently, and at node 1's next pause it stopped itself as
    "taken over" by its own pid. Now a claim that is no token of the cluster's key is
    counted in refused and ignored; node 1 writes its own back."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S

    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    replica = other.attach("p")
    _attacker(store).set("shared_td/claim/1", forged)
    td = owner.publish("p", shared_td.TensorDict(x=torch.full((4,), 3.0), batch_size=[4]))  # a new generation
    assert wait_until(lambda: other._replicas["p"].generation == 2, 10)  # renewed: its record counted
    replica = other.attach("p")
    td["x"].fill_(4.0)
    refused = owner.refused
    assert owner.sync("p", timeout=5).delivered == [1] and replica["x"].tolist() == [4.0] * 4
    assert refused >= 1  # (the has/ record's claim looked at once per generation)
    other._liveness._confirmed_at -= LOST_AFTER_S + 1  # as after a pause: it looks at its claim
    assert other.pull("p") == 4 and other._liveness.taken_over is None  # (renew 2, sync 3: each delivery a version)
    assert store.get("shared_td/claim/1") == other._claim.encode()  # written back
    assert other.refused >= 1


def test_a_clean_shutdown_still_lets_the_number_and_the_records_go(store):
    """The released claim of a clean shutdown (a token of the key, see the second
    round below) still takes a node's has/ record back (it is not a forgery)."""
    from shared_td.coordinator.cluster_liveness import claim_free

    owner, other = _pair(store)
    try:
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        other.attach("p")
        other.shutdown()
        assert claim_free(owner._store, 1, store.get("shared_td/claim/1"), owner._run)
        report = owner.sync("p", timeout=5)
        assert report.delivered == [] and report.dropped == {} and owner.refused == 0
        assert store.get("shared_td/has/p/1") == b""  # taken back
    finally:
        for member in (owner, other):
            member.shutdown()


# ---------------------------------------------------------------- finding 3
def _inodes_open() -> set:
    """(st_dev, st_ino) of this process's open descriptors."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            info = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        found.add((info.st_dev, info.st_ino))
    return found


def test_a_replica_nodes_cluster_is_freed_after_shutdown(store):
    """The replica's staleness entry held the node's Cluster for good (and with it its
    replicas' memory and its store connections): 8 MB and 6 sockets more per start,
    attach and shutdown. Counted on what the test's own clusters hold: the replica
    segments' memfds, and the Clusters themselves."""
    kept_segments, kept_clusters = [], []
    for _ in range(3):
        owner, other = _pair(store)
        owner.publish("p", shared_td.TensorDict(x=torch.zeros(1 << 16), batch_size=[1 << 16]))
        view = other.attach("p")
        segment = other._replicas["p"].segment
        info = os.fstat(segment.fd)
        kept_segments.append((info.st_dev, info.st_ino))
        kept_clusters.append(weakref.ref(other))
        for member in (owner, other):
            member.shutdown()
        assert view["x"].sum().item() == 0  # readable after shutdown
        with pytest.raises(RuntimeError, match="shut down"):
            shared_td.refresh(view)
        del view, segment, owner, other, member
    gc.collect()
    assert [ref() for ref in kept_clusters] == [None] * 3
    assert not set(kept_segments) & _inodes_open()


# ---------------------------------------------------------------- finding 4
def test_unpublish_of_a_cluster_held_name_is_refused_with_what_to_do(store):
    """unpublish of a replicated name forgot it on the owner's Coordinator only, while
    the cluster went on syncing and serving it (and a local re-publish then was never
    synced)."""
    with _coordinated(store) as (coords, members):
        coords[0].publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]), replicate=True)
        coords[1].attach("p")
        for coord, held in ((coords[0], "owned here"), (coords[1], "a replica")):
            with pytest.raises(ValueError, match=rf"'p' is held by this node's cluster \({held}\).*Publish 'p' again"):
                coord.unpublish("p")
        assert coords[0].attach("p")["x"].tolist() == [0.0] * 4 and members[0].sync("p").delivered == [1]
        coords[0].publish("local", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
        coords[0].unpublish("local")  # a name of this node only: as before


# ---------------------------------------------------------------- nit
def test_a_uint8_push_index_is_a_mask_as_torch_reads_it(store, pair):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    view = other.attach("p")
    view["x"].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    mask = torch.tensor([0, 1, 0, 1], dtype=torch.uint8)
    other.push("p", mask)
    assert td["x"].tolist() == [0.0, 2.0, 0.0, 4.0] == torch.where(mask.bool(), view["x"], 0.0).tolist()
    with pytest.raises(IndexError, match="needs 4 values"):
        other.push("p", torch.tensor([1, 1], dtype=torch.uint8))


# ======================================================= session 18, second round
@contextlib.contextmanager
def _coordinated(store):
    """Two Coordinators, each with its node of a cluster on ``store``, started; both
    shut down (clusters first) on leaving."""
    coords = [shared_td.Coordinator().start() for _ in range(2)]
    url = f"tcp://127.0.0.1:{store.port}?host=0"
    members = [Cluster(url, i, 2, authkey=KEY, timeout=8, coordinator=coords[i], hostname="127.0.0.1")
               for i in range(2)]
    for coord, member in zip(coords, members):
        coord.cluster = member
    try:
        errors = _start_together(members)
        if errors:
            raise errors[0]
        yield coords, members
    finally:
        for member in members:
            member.shutdown()
        for coord in coords:
            coord.shutdown()


def test_coordinator_attach_of_a_replicated_name_after_its_cluster_shut_down(store):
    """After shutdown() the names are left to the Coordinator: attach of a name
    published here with replicate=True asked the shut-down cluster and raised its
    RuntimeError (a regression of ea760c9, which cleared the cluster's owned names)."""
    with _coordinated(store) as (coords, members):
        coords[0].publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]), replicate=True)
        coords[1].attach("p")
        for member in (members[1], members[0]):
            member.shutdown()
        for coord in coords:  # (node 1's replica is published on its Coordinator too)
            assert coord.attach("p")["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
        coords[0].unpublish("p")
        with pytest.raises(KeyError, match="'p'"):  # a closed cluster is not asked (a RuntimeError)
            coords[0].attach("p")


def test_a_newer_only_write_whose_key_is_deleted_meanwhile_ends(store):
    """name/<name> deleted between the read and the compare-and-set of
    set_json_if_newer: TCPStore answers the expected bytes for a missing key, and the
    loop spun on them for good (inside the publish lock). Now it reads again."""
    from shared_td.coordinator.cluster_store import SignedStore

    signed = SignedStore(store, KEY, timeout=5)
    signed.set_json("name/p", {"generation": 1})
    attacker, real_check, looks = _attacker(store), signed.check, []

    def check(key, blob):  # the delete lands just after the first read
        looks.append(key)
        if len(looks) == 1:
            attacker.delete_key("shared_td/name/p")
        return real_check(key, blob)

    signed.check = check
    done = []
    writer = threading.Thread(target=lambda: done.append(signed.set_json_if_newer("name/p", {"generation": 2},
                                                                                  "generation")), daemon=True)
    writer.start()
    writer.join(5)
    assert done == [True] and len(looks) < 10, len(looks)
    assert SignedStore(store, KEY, timeout=5).get_json("name/p") == {"generation": 2}
    assert signed.set_json_if_newer("name/p", {"generation": 1}, "generation") is False  # kept the newer


def test_a_stopped_process_whose_successor_left_cleanly_does_not_come_back(store, pair):
    """Process A runs node 1, is stopped past LOST_AFTER_S; B takes node 1 over, then
    leaves cleanly. The emptied claim read as a forgery: A wrote its token back and ran
    on as node 1 with stale state. Now the released token B leaves is of the key: A
    is taken over."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, claim_free, claim_token, release_node

    owner, a = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    a.attach("p")
    b_token = claim_token(a._store, 1, a._run)  # B's takeover while A is stopped
    assert store.compare_set("shared_td/claim/1", a._claim, b_token) == b_token.encode()
    release_node(owner._store, 1, b_token, True, a._run)  # B's clean shutdown
    held = store.get("shared_td/claim/1")
    assert claim_free(owner._store, 1, held, a._run)  # the next process claims it at once
    a._liveness._confirmed_at -= LOST_AFTER_S + 1  # A runs again
    assert not a._liveness.still_mine() and "was taken over" in a._liveness.taken_over
    assert store.get("shared_td/claim/1") == held and a.refused == 0  # nothing written back


def test_leave_rejoin_leave_takes_the_first_processs_replica_record_back(store):
    """T1 (node 1) attaches, leaves; T2 runs as node 1, attaches nothing, leaves. T1's
    has/ record was counted as a forgery and kept at every sync (the first one waited
    3 s for node 1 to be lost). The released claim is of the key: the record is taken
    back, nothing refused, nothing waited for."""
    owner, t1 = _pair(store)
    t2 = None
    try:
        td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        t1.attach("p")
        t1.shutdown()
        t2 = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=KEY, timeout=8, hostname="127.0.0.1")
        t2.start()  # claims the released number at once
        t2.shutdown()
        td["x"].fill_(1.0)
        began = time.monotonic()
        report = owner.sync("p", timeout=5)
        assert time.monotonic() - began < 2.5  # (before: 3 s, waiting for node 1 to be lost)
        assert report.delivered == [] and report.dropped == {} and owner.refused == 0
        assert store.get("shared_td/has/p/1") == b""  # taken back
    finally:
        for member in (owner, t1, t2):
            if member is not None:
                member.shutdown()


def test_a_replicas_value_write_reads_the_small_generation_record(store, pair):
    """After each value write a replica node checks whether a newer publish replaced
    the generation: it read, checked and parsed the whole signed name record (the
    layout: 133 ms a write for 10,000 leaves). It reads gen/<name> now, whatever the
    size of the layout; is_stale too."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict({f"leaf{i:04d}": torch.zeros(2) for i in range(2000)}, task="a",
                                            batch_size=[2]), share_non_tensor=True)
    view = other.attach("p")
    read = []
    real = other._store.get_signed

    def get_signed(key):
        read.append(key)
        return real(key)

    other._store.get_signed = get_signed
    other._values._unless_replaced("p", 1, "p/1/0")
    assert not other.is_stale("p") and not shared_td.is_stale(view)
    assert read and "name/p" not in read and set(read) == {"gen/p"}
    other._store.get_signed = real
    # a forged gen/ record: counted, and the signed name record decides
    refused = other.refused
    _attacker(store).set("shared_td/gen/p", b"forged")
    assert not other.is_stale("p") and other.refused == refused + 1
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    assert other.is_stale("p") and owner._store.get_json("gen/p")["generation"] == 2


def test_a_publish_overtaken_inside_says_so(store, pair):
    """Node 0 stopped inside its publish while node 1 took the name over and published
    a newer generation: node 0's publish returned as if it had published, holding a
    generation no record named."""
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    real = owner._values.publish

    def paused(*args):  # node 0 stopped here; node 1 takes p over meanwhile
        from shared_td.coordinator.cluster_owners import owner_token

        mine, theirs = (owner_token(owner._store, "p", node, owner._run) for node in (0, 1))
        assert store.compare_set("shared_td/owner/p", mine, theirs) == theirs.encode()
        other.publish("p", shared_td.TensorDict(y=torch.ones(2), batch_size=[2]))
        return real(*args)

    owner._values.publish = paused
    with pytest.raises(ValueError, match=r"publish\('p'\) was taken over by node 1.*generation 3"):
        owner.publish("p", shared_td.TensorDict(z=torch.full((3,), 5.0), batch_size=[3]))
    assert "p" not in owner._owned and owner._taken_names["p"] == "1"
    with pytest.raises(KeyError, match="node 1 took it over"):
        owner.sync("p", timeout=5)
    assert list(other.attach("p").keys()) == ["y"]


def test_the_name_limit_leaves_room_for_the_publish_digest_in_a_push_header():
    """The digest a push header carries (32 hex digits) lowered the longest name from
    313 to 267 bytes; 16 digits tell publishes apart: 283 now, and still what fits."""
    from shared_td.coordinator.cluster_generations import layout_digest
    from shared_td.coordinator.cluster_push import _WORST_HEADER, MAX_NAME_BYTES, check_name

    assert len(layout_digest({"nbytes": 8})) == len(_WORST_HEADER["digest"]) == 16
    assert MAX_NAME_BYTES == 283
    check_name("n" * 283)
    with pytest.raises(ValueError, match="too long"):
        check_name("n" * 284)


def test_unpublish_of_a_name_this_node_gave_up_is_not_refused(store):
    """The refusal keyed on every name the cluster ever published here: a name taken
    over by another node while this one was stopped (so given up) stayed refused as
    "a replica" for good."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S

    with _coordinated(store) as (coords, members):
        coords[0].publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]), replicate=True)
        coords[1].attach("p")
        from shared_td.coordinator.cluster_owners import owner_token

        # node 1 took p over while node 0 was stopped
        store.set("shared_td/owner/p", owner_token(members[1]._store, "p", 1, members[1]._run))
        members[0]._liveness._confirmed_at -= LOST_AFTER_S + 1
        assert members[0]._liveness.still_mine() and "p" not in members[0]._owned
        coords[0].unpublish("p")  # (before: "held by this node's cluster (a replica)")
        with pytest.raises(ValueError, match=r"\(a replica\)"):  # node 1's replica: still refused
            coords[1].unpublish("p")


@pytest.mark.parametrize("junk", [b"1", b"junk"])
def test_a_forged_owner_claim_neither_makes_two_owners_nor_takes_a_name_away(store, pair, junk):
    """owner/<name> held a bare node number, unsigned: junk there let node 1 take a
    live owner's name (two owners), and "1" there made node 0 give its name up at its
    next pause. Now it holds a signed token: a forged one is counted and ignored."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S

    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    other.attach("p")
    attacker = _attacker(store)
    attacker.set("shared_td/owner/p", junk)
    with pytest.raises(ValueError, match="'p' is owned by node 0"):  # the signed record names node 0
        other.publish("p", shared_td.TensorDict(y=torch.ones(4), batch_size=[4]))
    assert other.refused == 1 and "p" in owner._owned
    attacker.set("shared_td/owner/p", junk)
    attacker.get("shared_td/owner/p")
    owner._liveness._confirmed_at -= LOST_AFTER_S + 1  # as after a pause: it looks at its names
    td["x"].fill_(3.0)
    assert owner.sync("p", timeout=5).delivered == [1] and "p" in owner._owned and owner.refused >= 1
    assert other.attach("p")["x"].tolist() == [3.0] * 4


def test_a_replayed_claim_token_is_a_forgery_not_a_takeover(store):
    """Any token of the key counted as a successor's: node 1's claim recorded in an
    earlier run with the same authkey, or an earlier process's token of this run (read
    in clear in its has/ record), written back cut node 1 out of every sync, nothing
    counted, and at its next pause node 1 stopped itself as "taken over". Tokens are
    bound to the run and carry a growing sequence now."""
    from shared_td.coordinator.cluster_liveness import LOST_AFTER_S

    earlier = loopback_store(10)
    members = _pair(earlier)
    recorded = earlier.get("shared_td/claim/1")  # an earlier run's token of node 1
    for member in members:
        member.shutdown()
    owner, first = _pair(store)
    other = None
    try:
        td = owner.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
        first.attach("p")
        first.shutdown()  # node 1's first process leaves: its token and its released one are known
        replays = [recorded, first._claim.encode(), store.get("shared_td/claim/1")]
        other = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=KEY, timeout=8, hostname="127.0.0.1")
        other.start()
        view = other.attach("p")
        for replay in replays:
            _attacker(store).set("shared_td/claim/1", replay)
            td["x"].add_(1.0)
            refused = other.refused
            report = owner.sync("p", timeout=5)
            assert report.delivered == [1] and view["x"].tolist() == td["x"].tolist()
            other._liveness._confirmed_at -= LOST_AFTER_S + 1  # node 1's next pause
            assert other._liveness.still_mine() and other._liveness.taken_over is None
            assert store.get("shared_td/claim/1") == other._claim.encode()  # written back
            assert other.refused == refused + 1
        assert owner.refused >= 1  # (a has/ record's claim is looked at once per generation)
    finally:
        for member in (owner, first, other):
            if member is not None:
                member.shutdown()
