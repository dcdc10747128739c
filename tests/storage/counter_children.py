"""Child-process targets for test_counter.py, importable by name for spawn children."""
import random
import threading


def reserve_many(counter, calls, threads, seed, queue):
    """Reserve ``calls`` random-sized slot ranges from each of ``threads`` threads at
    once; report every ``(start, n)`` handed out, or the error."""
    try:
        reservations = []
        gate = threading.Barrier(threads)

        def hammer(thread_seed):
            rng = random.Random(thread_seed)
            gate.wait(30)  # all threads of this process contend from the first call
            for _ in range(calls):
                n = rng.randint(1, 5)
                reservations.append((counter.fetch_add(n), n))  # list.append is atomic

        workers = [threading.Thread(target=hammer, args=(seed * 100 + i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
        queue.put(("ok", reservations))
    except BaseException as err:
        queue.put(("error", repr(err)))
        raise


def add_one(counter, queue):
    """One fetch_add; report the old value."""
    queue.put(counter.fetch_add(1))
