"""The actor/learner demo across two nodes (``python -m shared_td demo --nodes 2``), on
loopback: the learner on node 0, the actors on node 1, each node its own process tree.

* Node 0 is the process that runs the demo: it hosts the cluster's ``TCPStore`` on a
  free port of 127.0.0.1, starts its ``Coordinator(cluster=..., node=0, nodes=2)``,
  publishes the replay buffer and the ``policy`` (weights and their version) with
  ``replicate=True``, and spawns the learner, which attaches them through node 0's
  coordinator as on one machine. Whenever the learner makes a new policy version, node 0
  copies it into ``policy`` and ``sync``\\ s it to node 1.
* Node 1 is a spawned process with its own Coordinator (node=1) and its own spawned
  actors. It attaches the buffer and the policy (one replica segment each, filled over
  gloo), publishes its ``actors`` state (grants, counts, rewards) replicated too, and
  runs the *agent* loop: it reserves each actor's next rows from the cluster-wide cursor
  (``coord.counter("demo/cursor")``, one ``TCPStore.add``), and once an actor wrote them
  into node 1's replica, ``push``\\ es those rows to node 0's buffer and counts them in
  ``coord.counter("demo/written")``; each push takes a ticket from a cluster-wide counter
  before and after, recorded with every batch it carried in ``actors["batches"]``, so
  that the end-of-run check tells a late push from a lost one. The actors never talk to
  the network.
* The two nodes step through stages on a cluster counter (``demo/stage``: published,
  node 1 ready, run, stop, node 1 drained, done); every wait is bounded, and a failure on
  either side (``demo/abort``) stops both. At the end node 0 pulls node 1's ``actors``
  state and checks, as on one node, that every slot the cursor handed out was written
  exactly once and that the processes of each node map one segment.
"""
from __future__ import annotations

import multiprocessing
import os
import secrets
import sys
import time
from contextlib import contextmanager

import torch

from shared_td import Coordinator, DemoNodeStoppedError, SharedCounter, TensorDict
from shared_td.coordinator.store_host import host_tcp_store
from shared_td.demo.actor import run_node_actor
from shared_td.demo.learner import run_learner
from shared_td.demo.replay import (NUM_ACTIONS, OBS_SIZE, backing_inode, batch_history, replay_layout, slots_check,
                                   state_layout)
from shared_td.demo.session import START_TIMEOUT, DemoResult, run_with_progress
from shared_td.demo.supervise import (STOP_TIMEOUT, check_alive, ignore_ctrl_c, manager_answers, start_all, stop,
                                      wait_for)

__all__ = ["actors_layout", "node1_main", "node_slots_check", "policy_layout", "run_two_nodes"]

#: Seconds any cluster call, and any wait for the other node, may take.
CLUSTER_TIMEOUT = 60.0

# The stages of a run, the values of the ``demo/stage`` counter.
PUBLISHED, NODE1_READY, RUN, STOP, DRAINED, DONE = range(1, 7)


def policy_layout() -> TensorDict:
    """What node 0 replicates to node 1 for the actors: the weights and their version."""
    return TensorDict(weights=torch.zeros(NUM_ACTIONS, OBS_SIZE),
                      version=torch.zeros((), dtype=torch.int64), batch_size=[])


def actors_layout(actors: int, history: int = 0) -> TensorDict:
    """Node 1's state, replicated to node 0 for the end-of-run checks: ``phase`` (0
    starting, 1 running, 2 stop), ``ready``/``inode`` per actor, the agent's ``grant``
    (cursor position handed to each actor, -1 none) and the actors' ``filled`` (the last
    granted position written), rows ``written`` (pushed) and ``mean_reward`` per actor,
    and ``same_memory`` (node 1's actors all map its replica of the buffer). With
    ``history`` (``replay.batch_history``), ``batches``: each actor's last ``history``
    batches as (cursor start, ticket before the push that carried it, ticket after), -1
    unused, as ``state_layout``'s on one node (:func:`node_slots_check`)."""
    extra = {"batches": torch.full((actors, history, 3), -1, dtype=torch.int64)} if history else {}
    return TensorDict(
        phase=torch.zeros((), dtype=torch.int64),
        ready=torch.zeros(actors, dtype=torch.bool),
        inode=torch.zeros(actors, dtype=torch.int64),
        grant=torch.full((actors,), -1, dtype=torch.int64),
        filled=torch.full((actors,), -1, dtype=torch.int64),
        written=torch.zeros(actors, dtype=torch.int64),
        mean_reward=torch.zeros(actors),
        same_memory=torch.zeros((), dtype=torch.bool),
        **extra,
        batch_size=[],
    )


def node_slots_check(buffer: TensorDict, reserved: int, written: int, actors_state: TensorDict,
                     batch_size: int) -> tuple[bool, str]:
    """The end-of-run check of a two-node run, as ``replay.slots_check`` on one node:
    every slot the cluster cursor handed out reached node 0's ``buffer`` exactly once,
    with node 1's batch history (``actors_state["batches"]``: the tickets of the push
    that carried each batch) telling a late push (one that node 0 wrote after the next
    lap's) from a lost one (a push that returned but whose rows never landed: before,
    the rows kept the previous lap's positions and passed as late writes), at most one
    late batch per actor; and node 1's count of rows pushed equal to node 0's.

    Example (two laps of a 4-row ring in 2-row batches, each pushed at once)::

        >>> ring, state = replay_layout(capacity=4), actors_layout(actors=1, history=4)
        >>> ring["index"][:] = torch.tensor([4, 5, 6, 7])
        >>> state["batches"][0] = torch.tensor([[0, 0, 1], [2, 2, 3], [4, 4, 5], [6, 6, 7]])
        >>> state["written"][0] = 8
        >>> node_slots_check(ring, reserved=8, written=8, actors_state=state, batch_size=2)
        (True, 'reserved 8 slots = written 8; every slot written exactly once')
    """
    batches = actors_state["batches"] if "batches" in actors_state.keys() else None
    ok, message = slots_check(buffer, reserved, written, late_rows=len(actors_state["written"]) * batch_size,
                              batches=None if batches is None else batches.reshape(-1, 3), batch_size=batch_size)
    pushed = int(actors_state["written"].sum())
    if pushed != written:
        return False, f"node 1 counted {pushed:,} rows pushed, node 0 received {written:,}"
    return ok, message


@contextmanager
def loopback():
    """A TCPStore on a free port of 127.0.0.1 (hosted here: this process is node 0) with
    gloo bound to the loopback interface for the block; yields the store."""
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the spawned node 1 inherits it
    try:
        yield host_tcp_store("127.0.0.1", 0, timeout=CLUSTER_TIMEOUT)
    finally:
        if saved is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved


class NodeStages:
    """The stage counter both nodes step through, and the abort flag; every wait is
    bounded and gives up when the other node aborted or (``alive``) died."""

    def __init__(self, coord: Coordinator, other: str = "the other node"):
        self._other = other  # its name, in the errors
        self._stage = coord.counter("demo/stage")
        self._abort = coord.counter("demo/abort")
        self._interrupted = coord.counter("demo/interrupted")

    def reach(self, stage: int) -> None:
        """Announce ``stage`` (each stage is announced once, by one node)."""
        self._stage.fetch_add(stage - self._stage.fetch_add(0))

    @property
    def now(self) -> int:
        return self._stage.value

    def abort(self, interrupted: bool = False) -> None:
        """Stop both nodes; ``interrupted``: by the user's Ctrl-C, not a failure."""
        if interrupted:  # before the abort: the other node reads it once it sees the abort
            self._interrupted.fetch_add(1)
        self._abort.fetch_add(1)

    def aborted(self) -> bool:
        return self._abort.value > 0

    def check_abort(self, what: str) -> None:
        """:class:`DemoNodeStoppedError` if the other node aborted."""
        if self.aborted():
            raise DemoNodeStoppedError(self._other, what, interrupted=self._interrupted.value > 0)

    def wait(self, stage: int, timeout: float, what: str, alive=lambda: None) -> None:
        deadline = time.monotonic() + timeout
        while self._stage.value < stage:
            self.check_abort(f"while this one waited for {what}")
            alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not happen within {timeout:g} s")
            time.sleep(0.01)


def node1_main(url: str, authkey: bytes, actors: int, batch_size: int, pause: float) -> None:
    """Node 1 (a spawned process): its own Coordinator, its actors and the agent loop.
    Exits 0 after a complete run; on a failure of its own it announces the abort, stops
    its actors and exits 1 (with the traceback); when node 0 aborts, it stops its actors,
    prints one line and exits 1, or 130 when node 0 was interrupted (Ctrl-C)."""
    ignore_ctrl_c()  # Ctrl-C: node 0 stops us via the stages
    coord = Coordinator(cluster=url, node=1, nodes=2, authkey=authkey, timeout=CLUSTER_TIMEOUT)
    processes = []
    try:
        _node1_run(coord, processes, actors, batch_size, pause)
    except DemoNodeStoppedError as error:
        # node 0 reports its own failure, or the interrupt: one line here, no traceback
        print(f"shared_td demo (node 1): {error}; node 1 stopped its actors", file=sys.stderr, flush=True)
        raise SystemExit(130 if error.interrupted else 1) from None


def _node1_run(coord: Coordinator, processes: list, actors: int, batch_size: int, pause: float) -> None:
    """Node 1's run (``processes``: filled with its actors, stopped before this returns
    or raises)."""
    with coord:
        stages = NodeStages(coord, other="node 0")
        try:
            stages.wait(PUBLISHED, START_TIMEOUT, "node 0's publishing")
            buffer = coord.attach("replay")          # node 1's replica: one full transfer
            coord.attach("policy")
            history = batch_history(len(buffer), batch_size)  # (node_slots_check)
            state = coord.publish("actors", actors_layout(actors, history), replicate=True)
            ctx = multiprocessing.get_context("spawn")
            processes += [ctx.Process(target=run_node_actor, args=(coord, i, batch_size, pause),
                                      name=f"actor-{i} (node 1)") for i in range(actors)]
            start_all(processes)
            wait_for(lambda: bool(state["ready"].all()), processes, START_TIMEOUT, "start")
            stages.reach(NODE1_READY)
            stages.wait(RUN, START_TIMEOUT, "node 0's start", lambda: check_alive(processes, "start"))
            state["phase"].fill_(1)
            _agent(coord, stages, state, processes, batch_size, len(buffer))
            state["phase"].fill_(2)
            stop(processes, report=True)
            state["same_memory"].fill_(bool((state["inode"] == backing_inode(buffer["obs"])).all()))
            stages.reach(DRAINED)
            stages.wait(DONE, CLUSTER_TIMEOUT, "node 0's checks")  # node 0 pulls our state
        except BaseException as error:
            if not isinstance(error, DemoNodeStoppedError):
                stages_failed(coord, error)
            if processes:
                state["phase"].fill_(2)
                stop(processes, report=False)  # the error in flight says what went wrong
            raise


def stages_failed(coord: Coordinator, error: BaseException) -> None:
    """Tell the other node that this one failed or was interrupted (``error``), if the
    store is still there."""
    try:
        NodeStages(coord).abort(interrupted=isinstance(error, KeyboardInterrupt))
    except (RuntimeError, OSError):
        pass  # the store is gone: the other node sees ConnectionError by itself


def _agent(coord, stages: NodeStages, state, processes, batch_size: int, capacity: int) -> None:
    """Hand every actor its next rows from the cluster cursor and push the rows they
    wrote to node 0 (one push for all the actors that finished), until node 0 says stop;
    then stop granting, wait for the rows granted last, push them, and return."""
    cursor, written = coord.counter("demo/cursor"), coord.counter("demo/written")
    pushes = coord.counter("demo/pushes")
    # the order of the writes into node 0's buffer (the pushes), which the cursor (the
    # order of the grants) does not give: one ticket before a push, one after it
    tickets = SharedCounter("demo/tickets", cluster=coord)
    history = state["batches"] if "batches" in state.keys() else None
    recorded = [0] * len(state["grant"])  # batches recorded per actor
    grant, filled = state["grant"], state["filled"]
    granting, next_look = True, 0.0
    while True:
        done = [a for a in range(len(grant)) if int(grant[a]) == int(filled[a])]
        rows = [torch.arange(int(grant[a]), int(grant[a]) + batch_size) for a in done if int(grant[a]) >= 0]
        if rows:
            positions = torch.cat(rows)
            begun = tickets.fetch_add(1) if history is not None else -1
            coord.push("replay", positions % capacity)  # returns once node 0 wrote them
            ended = tickets.fetch_add(1) if history is not None else -1
            for a in done:
                if int(grant[a]) >= 0 and history is not None:  # (before the counts: a counted batch is recorded)
                    history[a][recorded[a] % history.shape[1]] = torch.tensor([int(grant[a]), begun, ended])
                    recorded[a] += 1
            written.fetch_add(len(positions))
            pushes.fetch_add(1)
            for a in done:
                if int(grant[a]) >= 0:
                    state["written"][a] += batch_size
        if granting:
            for a in done:
                grant[a] = cursor.fetch_add(batch_size)
        else:
            for a in done:
                grant[a] = filled[a] = -1  # nothing granted, nothing to push again
            if bool((grant < 0).all()):
                return
        if time.monotonic() >= next_look:  # the stage is a store round trip: not every step
            check_alive(processes, "run")
            stages.check_abort("during the run")
            granting = stages.now < STOP
            next_look = time.monotonic() + 0.05
        if not done:
            time.sleep(0.0005)


def run_two_nodes(seconds: float, actors: int, capacity: int, batch_size: int, stream) -> DemoResult:
    """Node 0's part of a two-node run (this process): host the store, start node 1, run,
    check; returns the result. RuntimeError if a process or a node fails or hangs."""
    ctx = multiprocessing.get_context("spawn")
    with loopback() as store:
        url = f"tcp://127.0.0.1:{store.port}?host=0"  # node 1 joins the store this process hosts
        authkey = secrets.token_bytes(32)  # one run's cluster key, handed over the spawn pipe
        node1 = ctx.Process(target=node1_main, args=(url, authkey, actors, batch_size, 0.002), name="node 1")
        start_all([node1])
        try:
            coord = Coordinator(cluster=store, node=0, nodes=2, authkey=authkey, timeout=CLUSTER_TIMEOUT)
            with coord:  # waits (bounded) for node 1 to join
                print(f"shared_td demo: starting 1 learner on node 0 and {actors} actor processes on "
                      f"node 1 (spawn), a cluster on 127.0.0.1:{store.port}", file=stream, flush=True)
                found = _run_node0(coord, node1, actors, capacity, batch_size, seconds, stream)
            stop([node1], report=True)  # node 1 left after node 0's checks: its exit code counts
        except BaseException as error:
            # it sees the abort (or the store gone) and stops
            stop([node1], report=False, announce=isinstance(error, KeyboardInterrupt))
            raise
    buffer, actors_state = found["buffer"], found["actors_state"]
    slots_ok, slots_message = node_slots_check(buffer, found["reserved"], found["written"], actors_state, batch_size)
    return DemoResult(
        seconds=found["elapsed"], actors=actors, capacity=capacity,
        buffer_bytes=sum(leaf.nbytes for leaf in buffer.values(True, True)),
        reference_bytes=0, reserved=found["reserved"], written=found["written"],
        sampled=found["sampled"], updates=found["updates"], policy_version=found["policy_version"],
        loss=found["loss"], mean_reward=float(actors_state["mean_reward"].mean()),
        same_memory=found["same_memory"], slots_ok=slots_ok, slots_message=slots_message,
        nodes=2, pushes=found["pushes"], syncs=found["syncs"], synced_version=found["synced_version"],
    )


def _run_node0(coord: Coordinator, node1, actors: int, capacity: int, batch_size: int,
               seconds: float, stream) -> dict:
    """Publish, start the learner, keep node 1's policy current while the progress line
    runs, stop, pull node 1's state. Returns what the result needs."""
    stages = NodeStages(coord, other="node 1")
    buffer = coord.publish("replay", replay_layout(capacity), replicate=True)
    policy = coord.publish("policy", policy_layout(), replicate=True)
    state = coord.publish("state", state_layout(0), share_non_tensor=True)
    landed = SharedCounter()  # rows pushed into this node's buffer: what the learner samples from
    stages.reach(PUBLISHED)
    learner = multiprocessing.get_context("spawn").Process(
        target=run_learner, args=(coord, landed, 0, 256, 20, 0.001), name="learner (node 0)")
    processes = [learner]
    node1_alive = lambda: check_alive([node1], "the run")  # noqa: E731
    try:
        start_all([learner])
        wait_for(lambda: bool(state["ready"].all()), [learner, node1], START_TIMEOUT, "start")
        stages.wait(NODE1_READY, START_TIMEOUT, "node 1's start", node1_alive)
        actors_state = coord.attach("actors")  # node 1's state: this node's replica of it
        written = coord.counter("demo/written")
        synced = {"version": 0, "syncs": 0}
        row_bytes = sum(leaf[0].nbytes for leaf in buffer.values(True, True))

        def step() -> int:
            """Keep the learner's sample range and node 1's policy current; returns the
            rows that reached this node."""
            check_alive([learner, node1], "run")
            stages.check_abort("during the run")
            arrived = written.value
            landed.fetch_add(arrived - landed.value)
            version = state["policy_version"]
            if version != synced["version"]:
                policy["weights"].copy_(state["weights"])
                policy["version"].fill_(version)
                report = coord.sync("policy")
                if report.dropped:
                    raise RuntimeError(f"node 1 was dropped from the policy sync: {report.dropped}")
                synced.update(version=version, syncs=synced["syncs"] + 1)
            return arrived

        stages.reach(RUN)
        elapsed = run_with_progress(state, seconds, row_bytes, stream, step)
        stages.reach(STOP)
        stages.wait(DRAINED, STOP_TIMEOUT, "node 1's last pushes", node1_alive)
        state["phase"].fill_(2)
        stop(processes, report=True)
        manager_answers(coord)
        coord.pull("actors")
        stages.reach(DONE)  # node 1 may leave
        return dict(
            elapsed=elapsed, buffer=buffer, actors_state=actors_state,
            reserved=coord.counter("demo/cursor").value, written=written.value,
            pushes=coord.counter("demo/pushes").value, syncs=synced["syncs"],
            synced_version=synced["version"],
            sampled=int(state["sampled"]), updates=int(state["updates"]),
            policy_version=state["policy_version"], loss=float(state["loss"]),
            same_memory=bool(state["inode"][0] == backing_inode(buffer["obs"]))
            and bool(actors_state["same_memory"]),
        )
    except BaseException as error:
        stages_failed(coord, error)
        state["phase"].fill_(2)
        # node 1 too: it saw the abort; one wait, one deadline, one notice for all
        stop(processes + [node1], report=False, announce=isinstance(error, KeyboardInterrupt))
        raise
