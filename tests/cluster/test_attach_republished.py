"""An attach that the owner's new publish overtakes is made again for the new generation:
before, the attach failed with a RuntimeError saying to attach again (its pull of the
generation it began with was refused, or that generation's value records were deleted).
Two cluster members of one process, on a loopback store; every wait bounded. (No
tensordict counterpart: tensordict has no cluster.)"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from shared_td.coordinator import cluster as cluster_module  # noqa: E402
from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures: two members of this process


def _buffer(value: float, text: str = "v"):
    return shared_td.TensorDict(w=torch.full((4, 2), value), text=text, batch_size=[4])


def _republishing(owner, other, step: str, times: int):
    """Make ``other``'s attach call ``step`` (its fill, or its read of the value records)
    after the owner published the name again, ``times`` times at most."""
    real = getattr(other, step) if step == "_fill" else other._values.latest
    done = []

    def overtaken(*args):
        if len(done) < times:
            done.append(owner.publish("buf", _buffer(10.0 + len(done), f"v{len(done)}"), share_non_tensor=True))
        return real(*args)

    if step == "_fill":
        other._fill = overtaken
    else:
        other._values.latest = overtaken
    return done


@pytest.mark.parametrize("step", ["_fill", "latest"])
def test_an_attach_overtaken_by_a_publish_gets_the_new_generation(pair, step):
    owner, other = pair
    owner.publish("buf", _buffer(1.0), share_non_tensor=True)
    published = _republishing(owner, other, step, times=1)
    view = other.attach("buf")
    assert len(published) == 1
    assert other._replicas["buf"].generation == 2 == owner.generation("buf")
    assert torch.equal(view["w"], torch.full((4, 2), 10.0)) and view["text"] == "v0"
    assert other.renew_failures == 0


def test_an_attach_overtaken_at_each_try_says_so(pair):
    owner, other = pair
    owner.publish("buf", _buffer(1.0), share_non_tensor=True)
    _republishing(owner, other, "_fill", times=cluster_module.ATTACH_TRIES)
    with pytest.raises(RuntimeError, match=rf"attach\('buf'\): 'buf' was published again "
                                           rf"{cluster_module.ATTACH_TRIES} times while this node attached it.*"
                                           r"Attach it again"):
        other.attach("buf")
    assert not other.replicates("buf")


def test_a_renew_thread_that_cannot_start_leaves_the_renews_for_the_next_notice(monkeypatch):
    """A failed start of the renew thread ("can't start new thread") left Renewals
    waiting for a thread that never ran: no later renew was made, and the node's
    shutdown (which joins its threads) raised on it. A stand-in node, as in the
    Renewals docstring."""
    import threading
    import types

    from shared_td.coordinator.cluster_renewals import Renewals

    made = []
    node = types.SimpleNamespace(_replicas={"p": types.SimpleNamespace(generation=1)}, _filling={}, _threads=[],
                                 _stop=threading.Event(), _closed=False, renew_failures=0, attach=made.append)
    renewals = Renewals(node)

    def cannot_start(thread):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", cannot_start)
        renewals.add("p", 2)  # nothing raised to the lane that got the notice
    assert node.renew_failures == 1 and node._threads == []
    renewals.add("p", 3)  # the next notice: both renews are made
    renewals.join(5.0)
    assert made == ["p", "p"]  # both queued renews (the stand-in's attach only records the call)
    for thread in node._threads:
        thread.join(5.0)  # what shutdown does: no thread that never started
