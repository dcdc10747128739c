"""review53: a failed renew's kept error (cluster_renewals.Renewals.failed, 8c199ec) must not keep the
failed attach's new segment alive through its traceback."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

pytest.importorskip("torch.distributed")

import shared_td  # noqa: E402
from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures
from tests.processes import wait_until  # noqa: E402

N, WIDTH = 8, 3


def _buffer(value: float):
    return shared_td.TensorDict(w=torch.full((N, WIDTH), value), batch_size=[N])


def test_a_failed_renew_keeps_its_error_not_the_new_generations_segment(pair):
    owner, other = pair
    owner.publish("buf", _buffer(1.0))
    other.attach("buf")
    real_fill = other._fill
    made = []

    def failing_fill(name, rep):
        if other._serving():  # the renew's, not the user's
            made.append(weakref.ref(rep.td))  # the new generation's tensordict, on its new segment
            raise OSError(24, "Too many open files")
        return real_fill(name, rep)

    other._fill = failing_fill
    owner.publish("buf", _buffer(5.0))
    assert wait_until(lambda: other.renew_failures == 1, 10)
    other._fill = real_fill
    gc.collect()
    assert len(made) == 1 and made[0]() is None  # (it lived on in failed's traceback)
    with pytest.raises(RuntimeError, match=r"its renew failed: OSError: .*Too many open files"):
        other.pull("buf")  # the refusal still says why
