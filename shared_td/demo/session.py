"""One run of the actor/learner demo: start a coordinator, publish the replay buffer and
the shared state, spawn the actors and the learner, show live throughput, stop them,
verify, and clean everything up. With ``nodes=2`` the learner and the actors run on two
cluster nodes over loopback (:mod:`shared_td.demo.nodes`).

Example:
    >>> result = run_demo(seconds=2, actors=2)          # doctest: +SKIP
    >>> result.ok, result.written == result.reserved    # doctest: +SKIP
    (True, True)
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import pickle
import sys
import time
from typing import TextIO

from shared_td import Coordinator, SharedCounter
from shared_td.demo.actor import run_actor
from shared_td.demo.learner import run_learner
from shared_td.demo.progress import ProgressLine, count, rate, size
from shared_td.demo.replay import backing_inode, batch_history, replay_layout, slots_check, state_layout
from shared_td.demo.supervise import check_alive, manager_answers, start_all, stop, wait_for

__all__ = ["DemoResult", "run_demo"]

START_TIMEOUT = 120.0  # seconds for the spawned processes to import torch and attach


@dataclasses.dataclass
class DemoResult:
    """What a run measured; ``ok`` when every check passed."""

    seconds: float
    actors: int
    capacity: int
    buffer_bytes: int
    reference_bytes: int
    reserved: int
    written: int
    sampled: int
    updates: int
    policy_version: int
    loss: float
    mean_reward: float
    same_memory: bool
    slots_ok: bool
    slots_message: str
    nodes: int = 1
    pushes: int = 0     # across nodes: push calls that carried the actors' rows to node 0
    syncs: int = 0      # across nodes: policy versions synced to node 1
    synced_version: int = 0  # across nodes: the last version synced, what node 1's actors read

    @property
    def ok(self) -> bool:
        return self.slots_ok and self.same_memory

    def summary(self) -> str:
        """The lines printed at the end of a run."""
        if self.nodes == 1:
            who = f"{self.actors} actor processes and 1 learner"
            mapping = ("map the same memory (one memfd inode, read in /proc/<pid>/maps)"
                       if self.same_memory else "DO NOT map the same memory")
            copies = (f"none: all {self.actors + 2} processes {mapping}; attaching the buffer sent "
                      f"{size(self.reference_bytes)} of references, no transition went through a "
                      "pipe or the coordinator")
        else:
            who = f"{self.actors} actor processes on node 1 and 1 learner on node 0"
            mapping = ("map its one copy of the buffer (one memfd inode per node)"
                       if self.same_memory else "DO NOT map their node's one copy")
            copies = (f"one per node: the processes of each node {mapping}; {self.pushes:,} pushes "
                      f"carried the rows to node 0 and {self.syncs:,} syncs the policy to node 1 "
                      "(gloo over loopback); no transition went through a pipe or a coordinator")
        return "\n".join([
            f"shared_td demo: {who} for {self.seconds:.1f} s"
            + (f" ({self.nodes} nodes over loopback)" if self.nodes > 1 else ""),
            f"  written  {self.written:,} transitions ({rate(self.written, self.seconds)}, "
            f"{size(self.written * self.buffer_bytes / self.capacity / self.seconds)}/s) into a "
            f"{size(self.buffer_bytes)} shared ring buffer of {self.capacity:,} rows",
            f"  sampled  {self.sampled:,} transitions ({rate(self.sampled, self.seconds)}) in "
            f"{self.updates:,} learner updates; loss {self.loss:.4f}",
            (f"  policy   version {self.policy_version} read by the actors from shared non-tensor state"
             if self.nodes == 1 else
             f"  policy   version {self.policy_version} made by the learner on node 0 (it trains until "
             f"the end); node 1's actors read up to version {self.synced_version}, the last synced "
             "to its replica")
            + f"; their mean reward {self.mean_reward:+.3f}",
            f"  cursor   {self.slots_message}",
            f"  copies   {copies}",
            "  result   " + ("OK" if self.ok else "FAILED"),
        ])


def min_capacity(actors: int, batch_size: int = 128) -> int:
    """The fewest rows the demo's ring takes: ``2 x actors x batch_size``. The actors
    write concurrently, one batch each in flight: in a ring not much larger than those
    batches two actors write the same rows at once at every lap, the slower overwriting
    the next lap's newer rows, and the late writes that ``slots_check`` accepts (at most
    one batch per actor, half the ring) would hide a lost one.

    Example:
        >>> min_capacity(actors=2)
        512
    """
    return 2 * actors * batch_size


def run_demo(seconds: float = 20.0, actors: int = 2, capacity: int = 1 << 18,
             batch_size: int = 128, stream: TextIO | None = None, nodes: int = 1) -> DemoResult:
    """Run the actor/learner demo for ``seconds`` (once every process is up) with
    ``actors`` actor processes and a buffer of ``capacity`` rows; live progress goes to
    ``stream`` (default stdout). ``nodes=2``: the learner on node 0 (this process), the
    actors on node 1, a cluster over loopback. Raises RuntimeError if a process fails or
    hangs; ValueError for a ``capacity`` under :func:`min_capacity`.
    """
    if actors < 1 or not 0 < seconds < math.inf or nodes not in (1, 2):
        raise ValueError(f"need actors >= 1, finite seconds > 0 and nodes 1 or 2; got {actors}, "
                         f"{seconds} and {nodes}")
    if capacity < min_capacity(actors, batch_size):
        raise ValueError(f"capacity (--buffer-size) must be at least {min_capacity(actors, batch_size):,} rows "
                         f"(2 x {actors} actors x {batch_size} rows per actor step), got {capacity:,}")
    stream = stream if stream is not None else sys.stdout
    if nodes == 2:
        from shared_td.demo.nodes import run_two_nodes  # the cluster's imports only when asked

        result = run_two_nodes(seconds, actors, capacity, batch_size, stream)
        print(result.summary(), file=stream, flush=True)
        return result
    with Coordinator() as coord:
        buffer = coord.publish("replay", replay_layout(capacity))
        state = coord.publish("state", state_layout(actors, batch_history(capacity, batch_size)),
                              share_non_tensor=True)
        cursor = SharedCounter()
        tickets = SharedCounter()  # the order of the writes (see run_actor)
        ctx = multiprocessing.get_context("spawn")  # the strictest start method
        processes = [
            ctx.Process(target=run_actor, args=(coord, cursor, i, batch_size, 0.002, tickets),
                        name=f"actor-{i}")
            for i in range(actors)
        ]
        processes.append(ctx.Process(
            target=run_learner, args=(coord, cursor, actors, 256, 20, 0.001), name="learner"))
        try:
            start_all(processes)
            print(f"shared_td demo: starting {actors} actor processes and 1 learner (spawn) "
                  f"on coordinator {coord.address}", file=stream, flush=True)
            wait_for(lambda: bool(state["ready"].all()), processes, START_TIMEOUT, "start")
            row_bytes = sum(leaf[0].nbytes for leaf in buffer.values(True, True))

            def step() -> int:
                check_alive(processes, "run")
                return int(state["written"].sum())

            elapsed = run_with_progress(state, seconds, row_bytes, stream, step)
        except BaseException as error:
            state["phase"].fill_(2)
            # the error in flight says what went wrong; after a Ctrl-C, say what we wait for
            stop(processes, report=False, announce=isinstance(error, KeyboardInterrupt))
            raise
        state["phase"].fill_(2)  # every process leaves its loop after this step
        stop(processes, report=True)
        manager_answers(coord)
        written = int(state["written"].sum())
        slots_ok, slots_message = slots_check(buffer, cursor.value, written, late_rows=actors * batch_size,
                                              batches=state["batches"].reshape(-1, 3), batch_size=batch_size)
        result = DemoResult(
            seconds=elapsed,
            actors=actors,
            capacity=capacity,
            buffer_bytes=sum(leaf.nbytes for leaf in buffer.values(True, True)),
            reference_bytes=len(pickle.dumps(buffer)),
            reserved=cursor.value,
            written=written,
            sampled=int(state["sampled"]),
            updates=int(state["updates"]),
            policy_version=state["policy_version"],
            loss=float(state["loss"]),
            mean_reward=float(state["mean_reward"].mean()),
            same_memory=bool((state["inode"] == backing_inode(buffer["obs"])).all()),
            slots_ok=slots_ok,
            slots_message=slots_message,
        )
    print(result.summary(), file=stream, flush=True)
    return result


def run_with_progress(state, seconds: float, row_bytes: int, stream: TextIO, step) -> float:
    """Let the workers run for ``seconds``, redrawing the progress line (``row_bytes``:
    the bytes of one transition; ``step()`` checks the processes, does what the run
    needs between two lines and returns the transitions written so far); returns the
    seconds they ran."""
    line = ProgressLine(stream)
    state["phase"].fill_(1)
    started = time.monotonic()
    try:
        while (elapsed := time.monotonic() - started) < seconds:
            written, sampled = step(), int(state["sampled"])
            line.update(elapsed / seconds, (
                f"{elapsed:4.1f}/{seconds:g} s  written {count(written)} ({rate(written, elapsed)}, "
                f"{size(written * row_bytes / max(elapsed, 1e-9))}/s)"
                f"  sampled {count(sampled)} ({rate(sampled, elapsed)})"
                f"  policy v{state['policy_version']}  loss {float(state['loss']):.3f}"))
            time.sleep(min(0.2, max(seconds - elapsed, 0.0)))
        return time.monotonic() - started
    finally:
        line.close()
