"""A cluster counter's key that something else wrote: the store's host adds to the
integer a value starts with and writes the sum back whole, so ``b"12abc"`` counted on
from 12 and the rest vanished. It is now found once, where the counter is made (and by
every ``value`` read), without a second round trip per ``fetch_add``."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")

from tests.cluster.test_cluster_store import KEY, _pair, store  # noqa: E402,F401 - store: a fixture

import shared_td  # noqa: E402
from shared_td.coordinator.cluster_counter import ClusterCounter  # noqa: E402
from shared_td.coordinator.cluster_store import SignedStore  # noqa: E402


def _set(store, key: str, value: bytes) -> None:
    store.set(f"shared_td/{key}", value)
    store.get(f"shared_td/{key}")  # (a TCPStore set is not answered: stored before the counter looks)


@pytest.mark.parametrize("held", [b"12abc", b" 12", b"+12", b"012", b"12 ", b"1e3", b"99999999999999999999", b""])
def test_a_counter_key_holding_what_is_not_a_stored_integer_is_named_when_the_counter_is_made(store, held):
    _set(store, "counter/cursor", held)
    signed = SignedStore(store, KEY, timeout=5)
    with pytest.raises(ValueError, match=r"'counter/cursor'.*holds b.*which is not an integer.*Nothing was read"):
        ClusterCounter(signed, "cursor")
    assert store.get("shared_td/counter/cursor") == held  # nothing added, nothing rewritten


def test_a_key_changed_after_the_counter_was_made_is_named_by_value(store):
    signed = SignedStore(store, KEY, timeout=5)
    cursor = ClusterCounter(signed, "cursor")
    assert cursor.value == 0 and not store.check(["shared_td/counter/cursor"])  # a read creates nothing
    assert cursor.fetch_add(5) == 0 and cursor.fetch_add(-7) == 5 and cursor.value == -2
    _set(store, "counter/cursor", b"12abc")
    with pytest.raises(ValueError, match=r"'counter/cursor'.*b'12abc'.*not an integer"):
        cursor.value  # noqa: B018 - the read is the check
    assert store.get("shared_td/counter/cursor") == b"12abc"
    _set(store, "counter/cursor", b"12")
    assert ClusterCounter(signed, "cursor").value == 12  # set back: made and read again


def test_shared_counter_of_a_cluster_names_a_key_written_by_something_else(store):
    members = _pair(store)
    try:
        _set(store, "counter/cursor", b"12abc")
        with pytest.raises(ValueError, match=r"'counter/cursor'.*b'12abc'.*not an integer"):
            shared_td.SharedCounter("cursor", cluster=members[1])
        _set(store, "counter/cursor", b"12")
        cursor = shared_td.SharedCounter("cursor", cluster=members[1])
        assert cursor.fetch_add(3) == 12 and shared_td.SharedCounter("cursor", cluster=members[0]).value == 15
    finally:
        for member in members:
            member.shutdown()
