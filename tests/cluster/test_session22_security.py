"""Session 22's security fixes of the cluster (audit 22), two members of one process on a
loopback store (see test_cluster_store.py; every wait bounded; no tensordict
counterpart: tensordict has no cluster):

- the cluster authkey is bytes-like or a str, 16 bytes at least, not zero bytes only
  (an int was read by ``bytes()`` as that many zero bytes: the empty HMAC key), and
  the store's values are signed with a hash of it (HMAC pads a short key with zeros);
- a value notice is unpickled only for a value this node holds, at a newer version;
- a drain of a queue ends at its deadline and after the values it found there (a
  flooded reply queue hung a pull for good);
- ``ClusterValues.restore`` never waits on the store (a deleted record held the values'
  lock, and every write of them, for the store's timeout);
- a deleted ``owner/<name>`` or ``claim/<node>`` is not free while its holder lives,
  and the holder writes it back.
"""
from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator.cluster import Cluster  # noqa: E402
from shared_td.coordinator.cluster_launch import cluster_key  # noqa: E402
from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore  # noqa: E402
from shared_td.coordinator.cluster_values import ClusterValues, encode  # noqa: E402
from tests.cluster.test_cluster_store import KEY, _members, pair, store  # noqa: E402,F401 - fixtures

UNPICKLED = []  # what a notice's payload ran when it was unpickled


def _record(what):
    UNPICKLED.append(what)


class _Marker:
    def __reduce__(self):
        return (_record, ("ran",))


def _wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


# ------------------------------------------------------------------ 1: the authkey
@pytest.mark.parametrize("authkey", [16, True, 1.5, [1] * 16])
def test_an_authkey_that_is_not_bytes_or_str_is_a_type_error(authkey):
    with pytest.raises(TypeError, match=f"bytes or a str, got a value of type {type(authkey).__name__}"):
        cluster_key(authkey)


@pytest.mark.parametrize("authkey", [b"k", "short key", b"\0" * 32, bytearray(16), " "])
def test_a_short_or_all_zero_authkey_is_a_value_error_that_says_how_to_make_one(authkey):
    with pytest.raises(ValueError, match=r"secrets\.token_hex\(16\)") as info:
        cluster_key(authkey)
    if isinstance(authkey, str):
        assert repr(authkey) not in str(info.value)  # a key is never shown


def test_the_authkey_from_the_environment_is_checked_too(monkeypatch):
    monkeypatch.setenv("SHARED_TD_CLUSTER_KEY", "1234")
    with pytest.raises(ValueError, match="4 bytes, fewer than 16"):
        cluster_key(None)
    monkeypatch.setenv("SHARED_TD_CLUSTER_KEY", "0123456789abcdef0123")
    assert cluster_key(None) == b"0123456789abcdef0123"
    assert cluster_key(memoryview(b"m" * 16)) == b"m" * 16


def test_keys_that_differ_by_trailing_zero_bytes_sign_differently(store):
    # HMAC pads a key shorter than its block with zero bytes: both keys signed alike
    SignedStore(store, b"k" * 16, timeout=5).set_json("name/a", {"owner": 0})
    with pytest.raises(ClusterAuthError, match="wrong signature"):
        SignedStore(store, b"k" * 16 + b"\0", timeout=5).get_json("name/a")
    assert SignedStore(store, b"\0" * 16, timeout=5).sign("x", b"") != SignedStore(store, b"", timeout=5).sign("x", b"")


def test_a_value_notice_is_unpickled_only_for_a_value_this_node_holds(store):
    values = ClusterValues(SignedStore(store, KEY, timeout=5), 1, 2, threading.Event())
    UNPICKLED.clear()
    notice = {"op": "value", "from": 0, "name": "p", "generation": 1, "digest": "", "index": 0, "version": 9,
              "payload": encode(_Marker())}
    assert pickle.loads(pickle.dumps(_Marker())) is None and UNPICKLED == ["ran"]  # (the marker works)
    UNPICKLED.clear()
    values.receive(notice)  # a name this node does not hold
    assert UNPICKLED == []


# ------------------------------------------------------------------ 2: drains
def test_a_drain_ends_at_its_deadline_and_after_what_it_found(store):
    signed = SignedStore(store, KEY, timeout=5)
    for _ in range(20):
        store.queue_push("shared_td/reply/1/0", b"junk")
    stop = threading.Event()
    pusher = store.clone()

    def flood():  # what anyone reaching the store could do
        end = time.monotonic() + 1.5
        while not stop.is_set() and time.monotonic() < end:
            pusher.queue_push("shared_td/reply/1/0", b"junk")

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        began = time.monotonic()
        dropped = signed.drain("reply/1/0")
        took = time.monotonic() - began
    finally:
        stop.set()
        flooder.join(5)
    assert took < 1.0 and 20 <= dropped < 20 + 10_000  # what it found then, not all that came after
    assert signed.drain("reply/1/0", time.monotonic() - 1) == 0  # past its deadline: nothing


# ------------------------------------------------------------------ 4: restore
def test_restore_of_a_deleted_value_record_does_not_wait_and_stores_it_again(store):
    owner, other = _members(store, (3.0, 3.0))
    try:
        owner.publish("cfg", shared_td.TensorDict(w=torch.zeros(2), task="walk", batch_size=[2]), share_non_tensor=True)
        generation = owner.generation("cfg")
        key = f"shared_td/value/cfg/{generation}/0"
        store.delete_key(key)
        began = time.monotonic()
        assert owner._values.restore("cfg", generation) == 1
        assert time.monotonic() - began < 1.0  # (a blocking get waited the store's timeout, holding the lock)
        assert store.check([key])
        assert other.attach("cfg")["task"] == "walk"
    finally:
        owner.shutdown()
        other.shutdown()


# ------------------------------------------------------------------ 3: deleted owner/ and claim/ keys
def test_a_deleted_owner_key_is_not_free_while_its_owner_lives_and_is_written_back(store, pair):
    owner, other = pair
    owner.publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]))
    held = store.get("shared_td/owner/p")
    store.delete_key("shared_td/owner/p")
    with pytest.raises(ValueError, match="'p' is owned by node 0"):
        other.publish("p", shared_td.TensorDict(x=torch.zeros(4), batch_size=[4]))
    assert other.refused == 1 and store.get("shared_td/owner/p") == held  # the live owner's token back
    assert owner.owner("p") == 0 and "p" in owner._owned
    store.delete_key("shared_td/owner/p")  # now the owner writes its own back, every few beats
    assert _wait_until(lambda: store.check(["shared_td/owner/p"]), 5)
    assert store.get("shared_td/owner/p") == held and "p" in owner._owned


def test_a_deleted_claim_refuses_a_second_process_and_is_written_back(store, pair):
    owner, other = pair
    held = store.get("shared_td/claim/1")
    store.delete_key("shared_td/claim/1")
    second = Cluster(f"tcp://127.0.0.1:{store.port}?host=0", 1, 2, authkey=KEY, timeout=5.0, hostname="127.0.0.1")
    try:
        with pytest.raises(ValueError, match="two processes were given node=1"):
            second.start()
    finally:
        second.shutdown()
    assert _wait_until(lambda: store.check(["shared_td/claim/1"]) and store.get("shared_td/claim/1") == held, 5)
    assert other._liveness.still_mine() and other.refused >= 1


# ------------------------------------------------------------------ 5: replayed lane requests
def test_a_replayed_sync_request_is_refused_and_counted(store, pair, monkeypatch):
    owner, other = pair
    td = owner.publish("p", shared_td.TensorDict(x=torch.arange(4.0), batch_size=[4]))
    view = other.attach("p")
    sent, push_json = [], owner._store.push_json

    def recording(queue, value):  # what a reader of the store's traffic sees (the signed bytes)
        sent.append((queue, value))
        push_json(queue, value)

    monkeypatch.setattr(owner._store, "push_json", recording)
    td["x"].add_(1)
    assert owner.sync("p").delivered == [1]
    version, refused = shared_td.version(view), other.refused
    queue, request = next((q, v) for q, v in sent if v.get("op") == "sync")
    push_json(queue, request)  # the same signed bytes again (HMAC: the same value signs alike)
    assert _wait_until(lambda: other.refused == refused + 1, 5)
    assert shared_td.version(view) == version and view["x"].tolist() == [1.0, 2.0, 3.0, 4.0]
    td["x"].add_(1)  # the pair is intact: the next sync is delivered at once
    assert owner.sync("p").delivered == [1] and view["x"].tolist() == [2.0, 3.0, 4.0, 5.0]
