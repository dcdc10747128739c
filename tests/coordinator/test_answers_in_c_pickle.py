"""The manager's answers are pickled by the standard library's pickle, in C, and read so.

The Connection's own ``send``/``recv`` pickle through dill, in Python: ~40 us of CPU a
call here, of a round trip of ~100 us (every ``attach``, ``names``, ``version``...).
An answer that only dill pickles still goes through it, one that nothing pickles comes
back as an error naming why, and the client reads both. tensordict 0.15.3 has no
coordinator: nothing to compare.
"""
from __future__ import annotations

import pickle

import pytest
import torch
from multiprocess.reduction import ForkingPickler

import shared_td
from shared_td.coordinator import accepting, channels

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def coord():
    with shared_td.Coordinator() as coord:
        coord.publish("w", shared_td.TensorDict(a=torch.arange(3.0)))
        yield coord


def test_an_answer_is_pickled_by_the_standard_pickle_and_read_without_dill(coord, monkeypatch):
    raw_answers = []

    def recording(conn):
        raw = conn.recv_bytes()
        raw_answers.append(raw)
        return pickle.loads(raw)

    def no_dill(*args, **kwargs):
        raise AssertionError("the answer was unpickled through dill")

    monkeypatch.setattr(channels, "_answer", recording)
    monkeypatch.setattr(ForkingPickler, "loads", no_dill)
    assert coord.names() == ["w"]
    assert coord.attach("w")["a"].tolist() == [0.0, 1.0, 2.0]
    assert len(raw_answers) >= 2
    for raw in raw_answers:
        # what pickle.dumps at its highest protocol writes (dill writes protocol 4)
        assert raw == pickle.dumps(pickle.loads(raw), pickle.HIGHEST_PROTOCOL)


def test_errors_of_the_registry_and_refused_calls_still_come_back(coord):
    with pytest.raises(KeyError, match="nope"):
        coord.attach("nope")
    with pytest.raises(Exception, match="not in exposed"):
        channels.call(coord.address, coord.authkey, "__init__", timeout=10)


def test_an_answer_only_dill_pickles_goes_through_dill_and_reads_with_pickle():
    answer = accepting._answer_bytes(("#RETURN", lambda x: x + 1))
    kind, function = pickle.loads(answer)
    assert kind == "#RETURN" and function(1) == 2


def test_an_answer_nothing_pickles_comes_back_as_the_reason():
    def generator():
        yield 1

    kind, text = pickle.loads(accepting._answer_bytes(("#RETURN", generator())))
    assert kind == "#UNSERIALIZABLE"
    assert "generator" in text
