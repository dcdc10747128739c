"""review53: a failed renew's kept error (cluster_renewals.Renewals.failed, 8c199ec) must not keep the
failed attach's new segment alive through its traceback."""
from __future__ import annotations

import gc

import pytest

pytest.importorskip("torch.distributed")

from tests.cluster.test_cluster_store import KEY, pair, store  # noqa: E402,F401 - fixtures
from tests.cluster.test_audit16_renew import _buffer, failing_renews  # noqa: E402
from tests.processes import wait_until  # noqa: E402


def test_a_failed_renew_keeps_its_error_not_the_new_generations_segment(pair):
    owner, other = pair
    owner.publish("buf", _buffer(1.0))
    other.attach("buf")
    made = []
    real_fill = failing_renews(other, OSError(24, "Too many open files"), made)
    owner.publish("buf", _buffer(5.0))
    assert wait_until(lambda: other.renew_failures == 1, 10)
    other._fill = real_fill
    gc.collect()
    assert len(made) == 1 and made[0]() is None  # (it lived on in failed's traceback)
    with pytest.raises(RuntimeError, match=r"its renew failed: OSError: .*Too many open files"):
        other.pull("buf")  # the refusal still says why
