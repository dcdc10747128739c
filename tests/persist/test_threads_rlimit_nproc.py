"""A save's, load's or consolidate's num_threads pool when the user may start no thread (RLIMIT_NPROC):
the pool's work is done by the threads that started, or in the calling thread when none
did (before: RuntimeError "can't start new thread", naming no limit, also when some pool
threads had started), and a return_early
write, whose own thread cannot start, names RLIMIT_NPROC. (limits22)"""
from tests.processes import run_as_nobody

_UID = 2_000_022  # no other process runs as this user: RLIMIT_NPROC counts the check's tasks only


def test_memmap_and_load_threads_under_rlimit_nproc():
    run_as_nobody("""
    import resource
    import time
    import torch
    import shared_td
    torch.set_num_threads(1)  # a fork child of a process whose torch used its thread pool may hang

    def tree(v):
        return shared_td.TensorDict({f"k{i}": torch.full((4, 1 << 17), float(v + i)) for i in range(6)},
                                    batch_size=[4])

    def warm(base):
        tree(0).memmap(base + "/warm", num_threads=2)
        shared_td.load_memmap(base + "/warm", num_threads=2)

    def settled(tasks):  # (a joined thread's task leaves /proc a moment after its join returns)
        deadline = time.monotonic() + 5
        while len(os.listdir("/proc/self/task")) != tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(os.listdir("/proc/self/task")) == tasks

    def check(base):
        tasks = len(os.listdir("/proc/self/task"))
        hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        for room in (1, 2):  # some of the pool's threads start: they do the work
            resource.setrlimit(resource.RLIMIT_NPROC, (tasks + room, hard))
            try:
                tree(room).memmap_(base + f"/some{room}", num_threads=4)
                loaded = shared_td.load_memmap(base + f"/some{room}", num_threads=4)
                assert [float(loaded[f"k{i}"][0, 0]) for i in range(6)] == [room + i for i in range(6)]
                assert float(tree(room).consolidate(num_threads=4)["k5"][0, 0]) == room + 5.0
                del loaded
            finally:
                resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
            assert settled(tasks), "the pool's threads outlived the call"
        resource.setrlimit(resource.RLIMIT_NPROC, (tasks, hard))  # no thread may start
        try:
            saved = tree(1).memmap_(base + "/a", num_threads=4)
            assert float(saved["k5"][0, 0]) == 6.0
            tree(2).memmap_(base + "/a", num_threads=4, existsok=True)
            loaded = shared_td.load_memmap(base + "/a", num_threads=4)
            assert [float(loaded[f"k{i}"][0, 0]) for i in range(6)] == [2.0 + i for i in range(6)]
            assert float(tree(5).consolidate(num_threads=4)["k5"][0, 0]) == 10.0
            try:
                tree(3).memmap_(base + "/b", num_threads=4, return_early=True).result()
            except RuntimeError as error:
                assert "RLIMIT_NPROC" in str(error), error
            else:
                raise AssertionError("the return_early write's thread started")
            assert len(os.listdir("/proc/self/task")) == tasks
        finally:
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        assert float(tree(4).memmap_(base + "/b", num_threads=4, return_early=True).result()["k0"][0, 0]) == 4.0
        return True
    """, timeout=120, uid=_UID)
