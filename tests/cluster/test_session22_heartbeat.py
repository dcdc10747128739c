"""Session 22, round b: nothing the heartbeat thread does grows with the names a node
owns (audit of 94e3494, finding 1), on a loopback store (every wait bounded; no
tensordict counterpart: tensordict has no cluster):
- every third beat looked at each owned name's ``owner/<name>`` (a round trip each)
  before the next beat: on a store 10 ms away, 400 names spaced the beats 4.3 s apart
  and another node took the live owner's names over. The beat now reads the claim only;
  deleted owner keys are the watch thread's (one round trip while all are there, then
  chunks within a time budget), and the names taken over during a pause are looked at
  by the first other thread that asks ``still_mine`` after it;
- a name given up after a pause is one whose entry is still the one looked at: a
  publish that claimed it again meanwhile keeps its entry.
"""
from __future__ import annotations

import copy
import threading
import time
import types

import pytest
import torch

torch_dist = pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster_liveness, cluster_owner_keys  # noqa: E402
from shared_td.coordinator.cluster_liveness import LOST_AFTER_S, Liveness, claim_node  # noqa: E402
from shared_td.coordinator.cluster_owners import names_taken_over, owner_token  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402
from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures

DELAY = 0.01  # one store round trip of the slowed store (the probe's 10 ms)


class _Slow(SignedStore):
    """A store DELAY s away; the heartbeat writes are recorded (time, thread)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.beats, self.calls = [], 0

    def _trip(self):
        self.calls += 1
        time.sleep(DELAY)

    def get_unchecked(self, key):
        self._trip()
        return super().get_unchecked(key)

    def compare_set(self, key, expected, desired):
        self._trip()
        return super().compare_set(key, expected, desired)

    def set_json(self, key, value):
        self._trip()
        super().set_json(key, value)
        if key.startswith("hb/"):
            self.beats.append(time.monotonic())


def _beating(liveness, seconds: float) -> None:
    stop = liveness._stop
    beater = threading.Thread(target=liveness.beat, daemon=True)
    beater.start()
    try:
        time.sleep(seconds)
    finally:
        stop.set()
        beater.join(5)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_the_claims_look_of_the_heartbeat_is_one_round_trip_whatever_the_names(store, monkeypatch):
    """The cluster's on_confirm (a round trip per owned name: 120 names, 1.2 s) ran in
    the beat that looked at the claim; the beats stood still meanwhile."""
    monkeypatch.setattr(cluster_liveness, "_KEEP_RUN_EVERY", 1)  # (every third beat: each one here)
    signed = _Slow(store, KEY, timeout=5.0)
    try:
        token = claim_node(signed, 0)
        names = [f"n{i}" for i in range(120)]
        for name in names:
            SignedStore.compare_set(signed, f"owner/{name}", "", owner_token(signed, name, 0))  # (not slowed)
        looked = []

        def on_confirm():
            looked.append(threading.current_thread())
            names_taken_over(signed, 0, names, pytest.fail)

        liveness = Liveness(signed, 0, signed.get_json, token, threading.Event(), on_confirm=on_confirm)
        _beating(liveness, 1.4)
        assert len(signed.beats) >= 2 and max(_gaps(signed.beats)) < 0.8, _gaps(signed.beats)  # (before: 1 beat)
        assert looked == []  # no gap: nothing to look at
    finally:
        signed.close()


def test_after_a_pause_the_heartbeat_thread_leaves_the_names_to_the_next_caller(store):
    """After a pause past LOST_AFTER_S the heartbeat thread's own look ran on_confirm
    (the names, a round trip each) before its next beat; the next caller of still_mine
    runs it now, and waits for it before it acts as the node."""
    signed = _Slow(store, KEY, timeout=5.0)
    try:
        token = claim_node(signed, 1)
        looked, delay = [], [0.6]

        def on_confirm():  # as 60 names 10 ms away
            time.sleep(delay[0])
            looked.append(threading.current_thread())

        liveness = Liveness(signed, 1, signed.get_json, token, threading.Event(), on_confirm=on_confirm)
        liveness._confirmed_at -= LOST_AFTER_S  # as after a stop
        beats = signed.beats
        _beating(liveness, 1.2)
        # the look's beat and the beat after it at once, then one HEARTBEAT_S later
        assert len(beats) >= 3 and max(_gaps(beats)) < 0.8, _gaps(beats)  # (before: 2, 0.6 s apart)
        assert looked == []
        delay[0] = 0.0
        assert liveness.still_mine() and looked == [threading.current_thread()]
        assert liveness.still_mine() and len(looked) == 1  # looked at once per gap
    finally:
        signed.close()


def _keeper(signed, names, still_mine=lambda: True):
    refused = []
    cluster = types.SimpleNamespace(_owned=dict.fromkeys(names, object()), _store=signed, node=0, _run="",
                                    _count_refused=lambda: refused.append(1),
                                    _liveness=types.SimpleNamespace(still_mine=still_mine))
    keys = cluster_owner_keys.OwnerKeys(cluster)
    keys._due = 0.0  # (due now)
    return keys, refused


def test_the_watch_threads_look_at_the_owner_keys_is_one_round_trip_while_all_are_there(store):
    signed = _Slow(store, KEY, timeout=5.0)
    try:
        names = [f"k{i}" for i in range(300)]
        for name in names:
            SignedStore.compare_set(signed, f"owner/{name}", "", owner_token(signed, name, 0))
        keys, refused = _keeper(signed, names)
        keys.keep()
        assert signed.calls == 0 and refused == []  # (one check of all the keys: not a slowed call)
        for name in ("k1", "k194"):
            store.delete_key(f"shared_td/owner/{name}")
        for _round in range(20):  # (each round within its budget: a chunk's 64 names take 0.64 s here)
            keys._due = 0.0
            keys.keep()
            if not keys._left:
                break
        assert refused == [1, 1] and keys._left == []
        for name in ("k1", "k194"):
            assert store.get(f"shared_td/owner/{name}") == owner_token(signed, name, 0).encode()
        keys.keep()  # not due again yet
        assert signed.calls <= 2 * 64 + 2  # name by name only in the two chunks with a missing key (of 300)
    finally:
        signed.close()


def test_the_watch_threads_look_name_by_name_ends_at_its_budget_and_goes_on_next_round(store, monkeypatch):
    monkeypatch.setattr(cluster_owner_keys, "KEEP_BUDGET_S", 0.1)  # (10 slowed round trips a round)
    signed = _Slow(store, KEY, timeout=5.0)
    try:
        names = [f"m{i}" for i in range(20)]  # none there: 20 to write back, 2 round trips each
        keys, refused = _keeper(signed, names)
        began = time.monotonic()
        keys.keep()
        assert time.monotonic() - began < 0.25 and 0 < len(refused) < 20 and keys._left  # (not all: 0.4 s)
        for _round in range(10):
            keys._due = 0.0
            keys.keep()
        assert len(refused) == 20 and keys._left == []
        assert all(store.get(f"shared_td/owner/{name}") == owner_token(signed, name, 0).encode() for name in names)
    finally:
        signed.close()


def test_a_name_published_again_during_the_look_after_a_pause_is_kept(pair):
    """The look after a pause gave up each name it found another node's by name: one
    published again by this node meanwhile (its new entry) was removed, and the node no
    longer served or synced a name it owned (audit 22, side note)."""
    owner, other = pair
    owner.publish("n", shared_td.TensorDict(x=torch.zeros(2), batch_size=[2]))
    theirs = owner_token(owner._store, "n", 1, owner._run)
    owner._store.compare_set("owner/n", owner_token(owner._store, "n", 0, owner._run), theirs)
    again = copy.copy(owner._owned["n"])
    read = owner._store.get_unchecked

    def reading(key):  # the look reads node 1's token; a publish of "n" then claims it again
        held = read(key)
        if key == "owner/n" and owner._owned.get("n") is not again:
            owner._owned["n"] = again
        return held

    owner._store.get_unchecked = reading
    owner._liveness._confirmed_at -= LOST_AFTER_S
    assert owner._liveness.still_mine()
    assert owner._owned.get("n") is again and "n" not in owner._taken_names
