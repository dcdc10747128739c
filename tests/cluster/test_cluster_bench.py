"""The cluster benchmark cases, tiny: every column runs, and ``sync`` is timed until a
worker process attached through the replica node's coordinator saw the new contents
(the case raises when it did not)."""
from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed")

from shared_td.bench.cases_cluster import case_cluster_counter, case_cluster_sync  # noqa: E402
from shared_td.bench.cases_cluster_push import case_cluster_push  # noqa: E402
from shared_td.bench.runner import BenchOptions  # noqa: E402
from shared_td.bench.worker import close_shared_worker  # noqa: E402
from tests.reference import needs_tensordict  # noqa: E402


@needs_tensordict
@pytest.mark.timeout(120)
def test_sync_case_runs_beside_raw_gloo_and_both_packages_send_and_init_remote(tmp_path):
    # 5 MiB: above STRIPE_MIN_BYTES, so that the striped syncs are striped
    results = case_cluster_sync(BenchOptions.quick(size_mib=5, repeat=2), str(tmp_path))
    assert list(results) == ["raw gloo send/recv", "raw gloo x2 groups", "raw gloo x4 groups",
                             "shared_td consolidated", "shared_td init_remote", "shared_td per leaf",
                             "tensordict consolidated", "tensordict init_remote", "tensordict per leaf",
                             "shared_td sync+worker", "shared_td sync x2 stripes+worker",
                             "shared_td sync x4 stripes+worker", "raw gloo send/recv, nodes' processes"]
    assert all(0 < seconds < 10 for seconds in results.values()), results


@pytest.mark.timeout(120)
def test_push_and_counter_cases_run(tmp_path):
    options = BenchOptions.quick(rounds=10, repeat=1)
    try:  # the owner node is a job of the run's worker process
        assert list(case_cluster_push(options, str(tmp_path))) == ["raw gloo send + 1 store round trip",
                                                                   "raw gloo send + answer (no work)",
                                                                   "shared_td push"]
    finally:
        close_shared_worker()
    assert list(case_cluster_counter(options, str(tmp_path))) == ["raw TCPStore.add", "shared_td fetch_add"]


@needs_tensordict
@pytest.mark.timeout(120)
def test_dist_batch_case_runs_both_packages_beside_the_raw_per_leaf_floor(tmp_path):
    from shared_td.bench.cases_dist_batch import case_dist_batch

    results = case_dist_batch(BenchOptions.quick(repeat=1), str(tmp_path))
    assert list(results) == ["raw isend/irecv per leaf", "shared_td isend/irecv", "tensordict isend/irecv",
                             "raw all_reduce per leaf", "shared_td all_reduce", "tensordict all_reduce"]
    assert all(0 < seconds < 10 for seconds in results.values()), results
