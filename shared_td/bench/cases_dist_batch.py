"""Benchmark case ``dist_batch``: what a distributed collector repeats, a batch of
transitions from a worker rank to the trainer rank with tensordict's ``isend``/``irecv``
(torchrl's collectors over torch.distributed do it once per batch), and a gradient-like
tree ``all_reduce``d, between two spawned ranks of a registered gloo group on loopback
(:mod:`~shared_td.bench.cases_cluster_peers` runs them). Columns:

* ``raw isend/irecv per leaf``: the same leaves as plain tensors, every transfer posted,
  then each waited for (the floor of a per-leaf send: no tree to walk);
* ``shared_td isend/irecv``, ``tensordict isend/irecv``: ``td.isend(dst=1)`` into
  ``td.irecv(src=0)`` of a tensordict of the same structure (shared memory on the
  receiver, as a trainer's buffer);
* ``raw all_reduce per leaf``, ``shared_td all_reduce``, ``tensordict all_reduce``: a
  tree of 16 parameter-like leaves, summed over both ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_ROWS = 256


def batch_tree(library, rows: int = _ROWS):
    """A batch of ``rows`` transitions as torchrl's collectors give them (13 leaves)."""
    step = {"observation": torch.zeros(rows, 84), "reward": torch.zeros(rows, 1),
            "done": torch.zeros(rows, 1, dtype=torch.bool), "terminated": torch.zeros(rows, 1, dtype=torch.bool),
            "truncated": torch.zeros(rows, 1, dtype=torch.bool)}
    return library.TensorDict({**{k: v.clone() for k, v in step.items() if k != "reward"},
                                "action": torch.zeros(rows, 6), "action_log_prob": torch.zeros(rows),
                                "collector": {"traj_ids": torch.zeros(rows, dtype=torch.int64)},
                                "next": {k: v.clone() for k, v in step.items()}},
                               batch_size=[rows])


def gradient_tree(library):
    """16 parameter-like leaves (8 layers: a weight and a bias each), 1.1 MB."""
    return library.TensorDict({f"layer{i}": {"weight": torch.ones(128, 256), "bias": torch.ones(256)}
                               for i in range(8)}, batch_size=[])


def batch_columns(rank: int, _nbytes: int, tensordict) -> dict:
    """The timed steps of rank ``rank`` (see the module's opening)."""
    import shared_td

    leaves = list(batch_tree(shared_td).values(True, True))  # (one order on both ranks: one construction)
    grads = list(gradient_tree(shared_td).values(True, True))
    if rank == 0:
        columns = {"raw isend/irecv per leaf": lambda: _all_waited(dist.isend(t, dst=1, tag=i)
                                                                   for i, t in enumerate(leaves))}
    else:
        columns = {"raw isend/irecv per leaf": lambda: _all_waited(dist.irecv(t, src=0, tag=i)
                                                                   for i, t in enumerate(leaves))}
    for library in (shared_td, tensordict):
        if library is None:
            continue
        name = library.__name__
        if rank == 0:
            td = batch_tree(library)
            columns[f"{name} isend/irecv"] = lambda td=td: td.isend(dst=1)
        else:
            td = batch_tree(library).share_memory_()
            columns[f"{name} isend/irecv"] = lambda td=td: td.irecv(src=0)
    columns["raw all_reduce per leaf"] = lambda: _all_waited(dist.all_reduce(t, async_op=True) for t in grads)
    for library in (shared_td, tensordict):
        if library is not None:
            columns[f"{library.__name__} all_reduce"] = lambda td=gradient_tree(library): td.all_reduce()
    return columns


def _all_waited(works) -> None:
    for work in list(works):
        work.wait()


def case_dist_batch(options, root: str) -> dict:
    """``isend``/``irecv`` of a collector's batch and ``all_reduce`` of gradients between
    two spawned ranks, beside the raw per-leaf floor and tensordict 0.15.3."""
    from shared_td.bench.cases_cluster_peers import start_peers

    # each step is short (0.1-1 ms): the best of many, each started from a barrier
    return start_peers(1 << 20, max(options.repeat * 6, 10), "spawn", columns_of=batch_columns).measure()
