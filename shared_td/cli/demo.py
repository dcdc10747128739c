"""``python -m shared_td demo``: actor processes feed a shared replay buffer that a
learner process trains from, live, with nothing copied between them.

``--nodes 2`` runs the same job on a two-node cluster over loopback: the learner on node 0
(this process, which hosts the TCPStore on a free port of 127.0.0.1), the actors on node
1 (a process tree of its own); the buffer and the policy are replicated, the actors'
rows pushed to node 0, the policy synced to node 1 (see :mod:`shared_td.demo.nodes`).

It starts a Coordinator, publishes the buffer and the shared state, spawns the actors
and the learner, shows throughput for ``--seconds``, stops everything, checks that the
shared cursor handed out every slot exactly once and that all processes mapped the same
memory, prints a summary and exits 0 (1 if a check or a process failed). It leaves no
file in the temp directory, nothing in /dev/shm and no child process.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_arguments(parser)
    >>> args = parser.parse_args(["--seconds", "3"])
    >>> args.seconds, args.actors, args.nodes
    (3.0, 2, 1)
    >>> run(args)                                          # doctest: +SKIP
    0
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import traceback


EPILOG = """examples:
  shared-td demo                              20 s, 2 actors, a 262,144-row buffer
  shared-td demo --seconds 5 --actors 4
  shared-td demo --buffer-size 4096           a small ring: the cursor wraps many times
  shared-td demo --nodes 2 --seconds 5        learner on node 0, actors on node 1 (loopback)

Exit code 0 when every check passed (each slot the shared cursor handed out written
exactly once, all processes mapping the same memory, no process failed), 1 otherwise
(also when the output is closed before the end: the checks did not run), 130 on Ctrl-C.
After a Ctrl-C the processes get up to 30 s to stop; a second Ctrl-C kills them at once. Nothing is left behind in the temp directory or /dev/shm."""


#: The fewest rows --buffer-size may give: one actor's batch (``run_demo``'s ``batch_size``;
#: not imported from there, which would import torch for ``--help``). With ``--actors``
#: it must be at least ``2 x actors x`` this (``session.min_capacity``), checked by ``run``.
MIN_BUFFER_ROWS = 128

#: Actor processes per CPU at most: each imports torch (~250 MiB), and past a few per
#: CPU they only wait for each other.
ACTORS_PER_CPU = 4


def max_actors() -> int:
    """The most ``--actors`` this machine takes: :data:`ACTORS_PER_CPU` per CPU this
    process may run on (at least 4).

    Example:
        >>> max_actors() >= 4
        True
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(4, ACTORS_PER_CPU * cpus)


def _positive(kind, least: int = 1, most=None):
    """An argparse type: a finite ``kind`` > 0 (for int: ``least`` .. ``most()``)."""
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive and finite, got {text}")
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {text}")
        if most is not None and value > most():
            raise argparse.ArgumentTypeError(
                f"at most {most()} on this machine ({ACTORS_PER_CPU} per CPU; each actor is a "
                f"process of ~250 MiB), got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser``."""
    parser.add_argument("--seconds", type=_positive(float), default=20.0,
                        help="how long the actors and the learner run, once started (default 20)")
    parser.add_argument("--actors", type=_positive(int, most=max_actors), default=2,
                        help=f"number of actor processes (default 2; at most {ACTORS_PER_CPU} per CPU)")
    # (positive here; its least, 2 x actors x MIN_BUFFER_ROWS, depends on --actors: run
    # checks it, so that `--buffer-size 100` names the 512 the default 2 actors need)
    parser.add_argument("--buffer-size", type=_positive(int), default=1 << 18,
                        help=f"rows of the shared ring buffer (default 262144, ~23 MiB; at least "
                             f"2 x actors x {MIN_BUFFER_ROWS})")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="1 (default): one machine; 2: the learner on node 0 and the actors "
                             "on node 1 of a cluster over loopback (127.0.0.1 only)")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code (0: every check passed)."""
    # imported here so that `python -m shared_td --help` does not pay for torch
    from shared_td.demo import run_demo

    least = 2 * args.actors * MIN_BUFFER_ROWS  # (session.min_capacity, without importing torch)
    if args.buffer_size < least:  # a usage error, as argparse's own (it checks one option at a time)
        print(f"shared-td demo: error: argument --buffer-size: must be at least {least} with "
              f"{args.actors} actors (2 x actors x {MIN_BUFFER_ROWS} rows per actor step), got "
              f"{args.buffer_size}", file=sys.stderr)
        return 2
    try:
        result = run_demo(seconds=args.seconds, actors=args.actors, capacity=args.buffer_size,
                          nodes=args.nodes)
    except BrokenPipeError:
        # `shared-td demo | head -1`: the run was cut short and nothing was checked, so
        # not the 0 that a reader leaving early means for `inspect`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        print("shared_td demo failed: its output was closed (broken pipe); the processes were "
              "stopped before the end of the run, nothing was checked", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError) as error:
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"shared_td demo failed: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        left = multiprocessing.active_children()  # reaps the ones that exited
        if left:
            print(f"shared_td demo interrupted; {len(left)} of its processes could not be stopped "
                  f"(pids {', '.join(str(p.pid) for p in left)})", file=sys.stderr)
        else:
            print("shared_td demo interrupted; everything was stopped", file=sys.stderr)
        return 130
    return 0 if result.ok else 1
