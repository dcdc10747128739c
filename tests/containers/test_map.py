"""``map`` and ``map_iter`` (before: an AttributeError, "not built"): the results side by
side with tensordict 0.15.3's, in fork workers (and spawn ones once); a worker that fn
fails in, or that dies (a real SIGKILL, also at a random moment), is an error that names
the chunk, within a bounded time, and no worker is left behind (tensordict's
multiprocessing.Pool waits for ever for the chunk of a killed worker)."""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import torch

import shared_td
from tests import map_functions as fns
from tests.reference import LIBS

FORK = {"num_workers": 2, "mp_start_method": "fork"}


def _data(lib, rows=6):
    return lib.TensorDict(row=torch.arange(rows), obs=torch.arange(rows * 3.0).reshape(rows, 3),
                          nested={"x": torch.ones(rows, 2)}, batch_size=[rows])


def _ours_left() -> list:
    """This process's map workers still alive (counted by name: only ours)."""
    return [child for child in multiprocessing.active_children() if child.name.startswith("shared_td-map-")]


def _map(td, fn, **options):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (tensordict's about the seed default)
        return td.map(fn, **{**FORK, **options})


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("options", [{}, {"chunksize": 2}, {"chunksize": 4}, {"num_chunks": 4},
                                     {"index_with_generator": True, "chunksize": 5}],
                         ids=["per worker", "chunksize 2", "chunksize 4", "num_chunks 4", "generator"])
def test_map_joins_the_results_of_every_chunk(lib, options):
    result = _map(_data(lib), fns.double, **options)
    assert result.batch_size == (6,) and result["row"].tolist() == [0, 2, 4, 6, 8, 10]
    assert result["nested", "x"].eq(2).all() and result["obs"].equal(_data(lib)["obs"] * 2)


@pytest.mark.parametrize("lib", LIBS)
def test_chunksize_zero_stacks_the_elements_and_dim_one_splits_there(lib):
    stacked = _map(_data(lib), fns.double, chunksize=0)
    assert stacked.batch_size == (6,) and stacked["row"].tolist() == [0, 2, 4, 6, 8, 10]
    wide = lib.TensorDict(a=torch.arange(8.0).reshape(2, 4), batch_size=[2, 4])
    assert _map(wide, fns.double, dim=1, chunksize=3)["a"].equal(wide["a"] * 2)


@pytest.mark.parametrize("lib", LIBS)
def test_none_results_and_tensor_results(lib):
    assert _map(_data(lib), fns.nothing) is None
    assert _map(_data(lib), fns.obs_sum, chunksize=4).tolist() == [3.0, 12.0, 21.0, 30.0, 39.0, 48.0]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["plain", "memmap", "shared"])
def test_out_receives_the_results(lib, kind, tmp_path):
    data = _data(lib)
    if kind == "memmap":
        data.memmap_(tmp_path / "data")
        out = data.memmap_like(tmp_path / "out")
    else:
        out = data.clone().zero_()
        if kind == "shared":
            out.share_memory_()
    assert _map(data, fns.double, out=out, chunksize=4) is out
    assert out["row"].tolist() == [0, 2, 4, 6, 8, 10] and out["nested", "x"].eq(2).all()


@pytest.mark.parametrize("lib", LIBS)
def test_a_tensorclass_is_mapped_in_its_class(lib):
    Steps = fns.steps_class(lib)
    result = _map(Steps(obs=torch.arange(4.0), batch_size=[4]), fns.double, chunksize=2)
    assert type(result) is Steps and result.obs.tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("lib", LIBS)
def test_map_iter_yields_in_order_and_shuffled(lib):
    import warnings

    data = _data(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        ordered = [chunk["row"].tolist() for chunk in data.map_iter(fns.double, chunksize=4, **FORK)]
        assert ordered == [[0, 2, 4, 6], [8, 10]]
        shuffled = [chunk["row"].tolist() for chunk in data.map_iter(fns.double, chunksize=2, shuffle=True, **FORK)]
        assert sorted(row for chunk in shuffled for row in chunk) == [0, 2, 4, 6, 8, 10]
        with pytest.raises(RuntimeError):
            next(data.map_iter(fns.double, shuffle=True, index_with_generator=False, **FORK))
        with pytest.raises(ValueError):
            data.map(fns.double, chunksize=2, num_chunks=2, **FORK)


@pytest.mark.parametrize("lib", LIBS)
def test_a_users_pool_runs_the_chunks(lib):
    with multiprocessing.get_context("fork").Pool(2) as pool:
        result = _data(lib).map(fns.double, pool=pool, chunksize=2)
    assert result["row"].tolist() == [0, 2, 4, 6, 8, 10]


@pytest.mark.parametrize("pools", ["multiprocessing", "multiprocess"])
def test_a_dead_worker_of_a_users_pool_is_an_error_naming_its_chunk(pools):
    """Its pool's imap would wait for ever: the chunk the worker held is lost."""
    context = __import__(pools).get_context("fork")
    with context.Pool(2) as pool:
        start = time.monotonic()
        with pytest.raises(shared_td.WorkerDiedError,
                           match=r"ended while it computed chunk 3 \(rows 3:4 along dim 0\): that chunk is lost"):
            # (into a shared out: no result travels back, so none is left half received by the
            # dying worker, which would end the pool's result thread first: the other error)
            data = _data(shared_td)
            data.map(fns.killed_on_row_3, pool=pool, chunksize=1, out=data.clone().share_memory_())
        assert time.monotonic() - start < 30


@pytest.mark.parametrize("seed", range(4))
def test_a_users_pool_worker_killed_at_a_random_moment_ends_the_map_within_a_bound(seed):
    rng = random.Random(seed)
    killed = []
    with multiprocessing.get_context("fork").Pool(2) as pool:
        workers = [process.pid for process in pool._pool]  # (the test's own view of its pool)

        def kill_one():
            time.sleep(rng.uniform(0.05, 0.6))
            killed.append(rng.choice(workers))
            os.kill(killed[0], signal.SIGKILL)

        killer = threading.Thread(target=kill_one)
        killer.start()
        start = time.monotonic()
        try:
            result = _data(shared_td, rows=8).map(fns.slow, pool=pool, chunksize=1)
        except shared_td.WorkerDiedError as error:  # (the chunk it computed, or a result it sent, lost)
            assert f"(pid {killed[0]})" in str(error) or "stopped receiving results" in str(error), error
        else:
            assert result["row"].tolist() == list(range(8))
        finally:
            killer.join(10)
        assert time.monotonic() - start < 30


def test_a_result_still_being_sent_by_a_live_worker_is_waited_for(monkeypatch):
    from shared_td.containers import pool_watch

    monkeypatch.setattr(pool_watch, "_RESULT_GRACE", 0.5)  # (shorter than the result takes to pickle)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = list(_data(shared_td).map_iter(fns.slow_to_send, pool=pool, chunksize=3))
    assert [result["row"].tolist() for result in results] == [[0, 1, 2], [3, 4, 5]]


def test_a_pool_whose_result_thread_ended_is_an_error_and_can_be_terminated():
    """Each worker exits once its task is done (maxtasksperchild=1), before the caller took
    the tensors of its result from it: the pool's result thread ends for good."""
    pool = multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1)
    try:
        start = time.monotonic()
        with pytest.raises(shared_td.WorkerDiedError, match="stopped receiving results"):
            _data(shared_td, rows=8).map(fns.double, pool=pool, chunksize=1)
        assert time.monotonic() - start < 30
    finally:
        pool.terminate()  # (raised CPython's AssertionError with this map's job left in its cache)
        pool.join()


def test_a_users_pool_gives_the_results_in_order_and_its_replaced_workers_are_no_error():
    data = _data(shared_td, rows=6)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        ordered = [chunk["row"].tolist() for chunk in data.map_iter(fns.slower_first, pool=pool, chunksize=1)]
    # (a worker per chunk, each replaced once done: results go into a shared out, nothing is sent back;
    # a tensor sent back by a worker that exits at once could not be received, see pool_watch.py)
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        out = data.clone().zero_().share_memory_()
        assert data.map(fns.slower_first, pool=pool, chunksize=1, out=out) is out
    assert ordered == [[0], [1], [2], [3], [4], [5]]
    assert out["row"].tolist() == [0, 1, 2, 3, 4, 5]


def test_workers_are_seeded_apart_and_alike_for_one_generator():
    data = _data(shared_td, rows=8)
    draws = _map(data, fns.random_rows, chunksize=1, max_tasks_per_child=1)["r"]
    assert len(set(draws.tolist())) == 8  # (each worker its own seed: no two rows alike)
    first = _map(data, fns.random_rows, num_workers=1, generator=torch.Generator().manual_seed(3))["r"]
    again = _map(data, fns.random_rows, num_workers=1, generator=torch.Generator().manual_seed(3))["r"]
    assert first.equal(again)


def test_spawn_workers_map_a_memory_mapped_tensordict_into_its_out(tmp_path):
    data = _data(shared_td).memmap_(tmp_path / "data")
    out = data.memmap_like(tmp_path / "out")
    assert data.map(fns.double, num_workers=2, chunksize=3, out=out, mp_start_method="spawn") is out
    assert shared_td.load_memmap(tmp_path / "out")["row"].tolist() == [0, 2, 4, 6, 8, 10]
    assert not _ours_left()


def test_an_error_in_fn_is_raised_with_the_workers_traceback():
    with pytest.raises(ValueError, match="row 3 is refused") as raised:
        _map(_data(shared_td), fns.fails_on_row_3, chunksize=1)
    assert "in the worker process" in str(raised.value.__cause__)
    assert "fails_on_row_3" in str(raised.value.__cause__)
    assert not _ours_left()


def test_a_worker_that_dies_is_an_error_naming_its_chunk():
    start = time.monotonic()
    with pytest.raises(shared_td.WorkerDiedError, match=r"killed by SIGKILL while it computed chunk 3 \(rows 3:4 along dim 0\)"):
        _map(_data(shared_td), fns.killed_on_row_3, chunksize=1)
    assert time.monotonic() - start < 30
    assert not _ours_left()


@pytest.mark.parametrize("seed", range(3))
def test_a_worker_killed_at_a_random_moment_ends_the_map_within_a_bound(seed):
    """A SIGKILL from outside (the OOM killer) at a random moment: the map raises
    shared_td.WorkerDiedError, or returns every row when the kill came after the last chunk."""
    rng = random.Random(seed)
    killed = []

    def kill_one():
        time.sleep(rng.uniform(0.05, 0.6))
        workers = _ours_left()
        if workers:
            victim = rng.choice(workers)
            killed.append(victim.pid)
            os.kill(victim.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_one)
    killer.start()
    start = time.monotonic()
    try:
        result = _map(_data(shared_td, rows=8), fns.slow, chunksize=1)
    except shared_td.WorkerDiedError as error:
        assert str(killed[0]) in str(error)
    else:
        assert result["row"].tolist() == list(range(8))
    finally:
        killer.join(10)
    assert time.monotonic() - start < 30
    assert not _ours_left()


def test_closing_map_iter_early_stops_the_workers():
    chunks = _data(shared_td, rows=8).map_iter(fns.slow, chunksize=1, **FORK)
    assert next(chunks)["row"].tolist() == [0]
    chunks.close()
    assert not _ours_left()


def test_pbar_counts_the_chunks_on_stderr(capsys):
    _map(_data(shared_td), fns.double, chunksize=2, pbar=True)
    assert "map(): 3 of 3 chunks" in capsys.readouterr().err


def test_several_threads_per_fork_worker_are_refused_before_any_worker_starts():
    """A forked worker's OpenMP threads hang once the parent used its own (measured:
    map(worker_threads=2) with fork never returned): refused, naming the fix."""
    data = _data(shared_td)
    (data["obs"] * 2).sum()  # (the parent's threads used, as in any program)
    with pytest.raises(ValueError, match="mp_start_method='spawn' or 'forkserver'"):
        data.map(fns.double, num_workers=2, worker_threads=2, mp_start_method="fork")
    assert not _ours_left()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_workers_end_soon_after_their_caller_is_sigkilled_mid_chunk(tmp_path, start_method):
    """The caller killed while its workers compute long chunks: each worker ends within a
    bound (before, it ran its chunk to the end: here 120 s of a core each)."""
    import subprocess
    import sys

    from tests import processes

    script = tmp_path / "caller.py"
    script.write_text(
        "import sys, torch, shared_td\n"
        "from tests import map_functions as fns\n"
        "if __name__ == '__main__':\n"
        f"    td = shared_td.TensorDict(x=torch.zeros(2), dir={str(tmp_path)!r}, batch_size=[2])\n"
        f"    td.map(fns.pid_file_then_sleep, num_workers=2, chunksize=1, mp_start_method={start_method!r})\n")
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def worker_pids():
            return [int(name.split(".")[0]) for name in os.listdir(tmp_path) if name.endswith(".pid")]
        processes.wait_until(lambda: len(worker_pids()) == 2 or caller.poll() is not None, timeout=60)
        assert len(worker_pids()) == 2, caller.stderr.read1().decode() if caller.poll() is not None else "no workers"
        caller.kill()
        caller.wait(10)
        pids = worker_pids()
        assert processes.wait_until(lambda: not any(processes.alive(pid) for pid in pids), timeout=10), pids
    finally:
        caller.kill()
        caller.wait(10)
        for pid in worker_pids():
            if processes.alive(pid):
                os.kill(pid, signal.SIGKILL)
