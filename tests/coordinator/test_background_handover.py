"""memmap_(share_non_tensor=True) hands its values to the embedded coordinator in the
background (issue 13, item 4): the caller does not wait for the coordinator's start,
what needs the coordinator waits for it, and a failure there is raised by the next
operation that needs it. Each case runs in a fresh interpreter (no coordinator
announced), whose embedded coordinator's start is slowed down or broken on purpose.
"""
from __future__ import annotations

import os
import textwrap

from tests.coordinator.test_nontensor_coordinator import run_script
from tests.processes import alive, wait_until

# the start of the embedded coordinator takes SLOW seconds more (a busy machine)
SLOW = """
    import json, os, pickle, time, multiprocessing, shared_td
    from shared_td.coordinator import ownership
    real_start = ownership._start_embedded
    def slow_start():
        time.sleep(2.0)
        return real_start()
    ownership._start_embedded = slow_start
    def recorded_holders(td):  # the holders recorded so far, without waiting for more
        return list(td.get("task")._shared_value.slab._holders)
"""


def slowly(body: str) -> dict:
    """run_script of ``body`` after SLOW."""
    return run_script(textwrap.dedent(SLOW) + textwrap.dedent(body))


def test_memmap_returns_before_the_coordinator_has_started_and_a_pickle_waits_for_it():
    out = slowly("""
        begin = time.monotonic()
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
        returned = time.monotonic() - begin
        holders_then = recorded_holders(td)  # not handed over yet
        blob = pickle.dumps(td)  # waits: the pickle names the coordinator
        waited = time.monotonic() - begin
        coord = ownership.embedded_coordinator(start=False)
        print(json.dumps({"returned": returned, "waited": waited, "then": holders_then,
                          "pid": coord.pid, "holders": pickle.loads(blob).get("task")._shared_value.holders,
                          "env": os.environ[ownership.ENV_VAR].split(";")[0], "address": coord.address}))
    """)
    assert out["returned"] < 1.0 and out["then"] == [], out  # did not wait for the start
    assert out["waited"] >= 2.0 and out["holders"][0][0] == out["pid"], out
    assert out["env"] == out["address"]
    assert wait_until(lambda: not alive(out["pid"]))


def test_a_fork_child_gets_the_coordinator_and_the_holders():
    out = slowly("""
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
        def child(queue):
            embedded = ownership._EMBEDDED  # inherited: the fork waited for the start
            queue.put((None if embedded is None else embedded.pid,
                       recorded_holders(td)))
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(queue,))
        process.start()
        embedded, holders = queue.get(timeout=30)
        process.join(30)
        print(json.dumps({"child": [embedded, holders], "pid": ownership.embedded_coordinator(start=False).pid,
                          "exitcode": process.exitcode}))
    """)
    assert out["exitcode"] == 0
    assert out["child"][0] == out["pid"] and out["child"][1][0][0] == out["pid"], out


def test_the_process_may_exit_right_after_memmap_the_coordinator_stops_with_it():
    out = slowly("""
        def announce():
            coord = slow_start()
            print(json.dumps({"pid": coord.pid, "address": coord.address}), flush=True)
            return coord
        ownership._start_embedded = announce
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)
        # and exits at once: the hand-over finishes, then the coordinator is stopped
    """)
    assert wait_until(lambda: not alive(out["pid"]))
    assert not os.path.exists(os.path.dirname(out["address"]))


def test_a_failed_start_is_raised_by_the_next_operation_that_needs_it_naming_its_cause():
    out = run_script("""
        import json, pickle, shared_td
        from concurrent import futures
        from shared_td.coordinator import ownership
        def broken_start():
            raise RuntimeError("no room for a manager process (test)")
        ownership._start_embedded = broken_start
        td = shared_td.TensorDict(task="walk").memmap_(share_non_tensor=True)  # returns
        errors = []
        try:
            pickle.dumps(td)
        except RuntimeError as err:
            errors.append(str(err) + " " + " ".join(getattr(err, "__notes__", [])))
        clone = pickle.loads(pickle.dumps(td))  # raised once: the value stays this process's
        again = shared_td.TensorDict(task="run").memmap_(share_non_tensor=True)
        # its hand-over has failed in the background (waited for without raising it)
        futures.wait([ownership._HANDOVER._latest], timeout=30)
        try:
            shared_td.TensorDict(task="jump").memmap_(share_non_tensor=True)
        except RuntimeError as err:
            errors.append(str(err))
        print(json.dumps({"errors": errors, "value": clone["task"],
                          "holders": list(td.get("task")._shared_value.holders)}))
    """)
    assert len(out["errors"]) == 2, out
    assert "no room for a manager process (test)" in out["errors"][0]
    assert "in the background" in out["errors"][0] and "share_non_tensor" in out["errors"][0]
    assert "no room for a manager process (test)" in out["errors"][1]  # the second one's
    assert out["value"] == "walk" and out["holders"] == []
