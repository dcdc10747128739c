"""review54: a job submitted to a ThreadPool that no thread will run is refused (before: its
future never completed, and whoever waited for it hung)."""
import os

import pytest

from shared_td.thread_pool import ThreadPool


def test_submit_after_shutdown_is_refused():
    pool = ThreadPool.start(2, "shared_td-test")
    pool.shutdown()
    pool.shutdown()  # (again: nothing)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(pow, 2, 3)


def test_fork_childs_copy_refuses_jobs():
    pool = ThreadPool.start(2, "shared_td-test")
    try:
        pid = os.fork()
        if pid == 0:
            try:
                pool.submit(pow, 2, 3)
            except RuntimeError:
                os._exit(0)
            os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        pool.shutdown()
