"""The shared pieces of the actor/learner demo: a ring replay buffer, the state the
learner shares with the actors, a toy environment, and the checks that prove no slot
was lost or written twice and that every process maps the same memory.

A transition row holds ``obs``, ``action``, ``reward``, ``next_obs``, ``done``, plus
``index`` (the cursor position that reserved the row, -1 before the first write) and
``policy_version`` (the version of the policy that acted).

Example:
    >>> buffer = replay_layout(capacity=8)
    >>> ring_rows(start=6, n=4, capacity=8).tolist()
    [6, 7, 0, 1]
    >>> expected_indices(reserved=10, capacity=8).tolist()
    [8, 9, 2, 3, 4, 5, 6, 7]
"""
from __future__ import annotations

import os
import time

import torch

from shared_td import NonTensorData, TensorDict
from shared_td.platform import CreatorWatch

__all__ = [
    "NUM_ACTIONS", "OBS_SIZE", "Env", "backing_inode", "batch_history", "check_in", "expected_indices",
    "greedy_actions", "replay_layout", "ring_rows", "running", "slots_check", "state_layout",
]

OBS_SIZE = 8
NUM_ACTIONS = 4


def replay_layout(capacity: int) -> TensorDict:
    """An empty (in-process) replay buffer of ``capacity`` rows, to be published."""
    return TensorDict(
        {
            "obs": torch.zeros(capacity, OBS_SIZE),
            "action": torch.zeros(capacity, dtype=torch.int64),
            "reward": torch.zeros(capacity),
            "next_obs": torch.zeros(capacity, OBS_SIZE),
            "done": torch.zeros(capacity, dtype=torch.bool),
            "index": torch.full((capacity,), -1, dtype=torch.int64),
            "policy_version": torch.zeros(capacity, dtype=torch.int64),
        },
        batch_size=[capacity],
    )


def state_layout(num_actors: int, history: int = 0) -> TensorDict:
    """What the processes share besides the buffer, to be published with
    ``share_non_tensor=True``.

    ``policy_version`` is a non-tensor value (shared through the coordinator's
    non-tensor mechanism); the rest are small tensors each written by one process only:
    ``phase`` (0 starting, 1 running, 2 stop; written by the parent), ``ready`` and
    ``inode`` (one slot per actor, then the learner's), ``written``/``mean_reward`` (one
    per actor), the learner's ``weights``, ``sampled``, ``updates`` and ``loss``. With
    ``history`` (:func:`batch_history`), ``batches``: each actor's last ``history``
    batches as (cursor start, ticket taken before its write, ticket after), -1 unused,
    for :func:`slots_check`.
    """
    processes = num_actors + 1
    extra = {"batches": torch.full((num_actors, history, 3), -1, dtype=torch.int64)} if history else {}
    return TensorDict(
        {
            "policy_version": NonTensorData(0),
            "phase": torch.zeros((), dtype=torch.int64),
            "ready": torch.zeros(processes, dtype=torch.bool),
            "inode": torch.zeros(processes, dtype=torch.int64),
            "written": torch.zeros(num_actors, dtype=torch.int64),
            "mean_reward": torch.zeros(num_actors),
            "weights": torch.zeros(NUM_ACTIONS, OBS_SIZE),
            "sampled": torch.zeros((), dtype=torch.int64),
            "updates": torch.zeros((), dtype=torch.int64),
            "loss": torch.zeros(()),
            **extra,
        },
        batch_size=[],
    )


def batch_history(capacity: int, batch_size: int) -> int:
    """How many of an actor's last batches ``slots_check`` needs: every batch with a
    position in the last two laps of the ring (those a row can still hold), plus one
    that straddles their start.

    Example:
        >>> batch_history(capacity=512, batch_size=128)
        10
    """
    return 2 * capacity // batch_size + 2


def ring_rows(start: int, n: int, capacity: int) -> torch.Tensor:
    """The buffer rows of cursor positions ``start .. start + n - 1`` (wrapping)."""
    return torch.arange(start, start + n) % capacity


class Env:
    """A contextual bandit: reward = ``true_weights[action] . obs`` + noise.

    Every actor builds the same hidden ``true_weights`` (seed 0); the learner never sees
    them and fits them from the rewards in the buffer.
    """

    def __init__(self, batch_size: int, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.true_weights = torch.randn(NUM_ACTIONS, OBS_SIZE, generator=torch.Generator().manual_seed(0))
        self.batch_size = batch_size
        self.obs = self._observe()

    def _observe(self) -> torch.Tensor:
        return torch.randn(self.batch_size, OBS_SIZE, generator=self.generator)

    def step(self, action: torch.Tensor) -> dict[str, torch.Tensor]:
        """One step of ``batch_size`` independent episodes; returns a transition batch."""
        obs, next_obs = self.obs, self._observe()
        noise = 0.1 * torch.randn(self.batch_size, generator=self.generator)
        reward = (self.true_weights[action] * obs).sum(-1) + noise
        done = torch.rand(self.batch_size, generator=self.generator) < 0.05
        self.obs = next_obs
        return {"obs": obs, "action": action, "reward": reward, "next_obs": next_obs, "done": done}


def greedy_actions(weights: torch.Tensor, obs: torch.Tensor, epsilon: float,
                   generator: torch.Generator) -> torch.Tensor:
    """The action the learned reward model rates best, or a random one with
    probability ``epsilon``."""
    best = (obs @ weights.T).argmax(-1)
    explore = torch.rand(len(obs), generator=generator) < epsilon
    random = torch.randint(NUM_ACTIONS, (len(obs),), generator=generator)
    return torch.where(explore, random, best)


def expected_indices(reserved: int, capacity: int) -> torch.Tensor:
    """What each row's ``index`` must hold once cursor positions ``0 .. reserved - 1``
    were all written: the last position that maps to the row, or -1 for none."""
    rows = torch.arange(capacity)
    last = rows + capacity * torch.div(reserved - 1 - rows, capacity, rounding_mode="floor")
    return torch.where(rows < reserved, last, torch.full_like(rows, -1))


def slots_check(buffer: TensorDict, reserved: int, written: int, late_rows: int | None = None,
                batches: torch.Tensor | None = None, batch_size: int | None = None) -> tuple[bool, str]:
    """Whether every reserved slot was written exactly once, and a sentence saying so.

    A slot handed out twice would make the actors' ``written`` counts exceed the cursor;
    a slot skipped or never written would leave a row with an older ``index`` (or -1).

    The cursor orders the reservations, not the writes: an actor that reserved a slot and
    was held up may write its row after another actor wrote the same row for the next lap
    (a late write). The row then holds the position one lap before the one expected: up
    to ``late_rows`` such rows are accepted and counted (each actor has one batch in
    flight, so at most one of its batches can end up late: ``actors x batch_size``; None:
    half the buffer, the most ``run_demo``'s ``capacity >= 2 x actors x batch_size``
    allows). Anything else (a row never written, one from two laps back or of another
    row, more late rows than that) fails.

    ``batches`` (rows of (cursor start, ticket before the write, ticket after), -1
    unused: the actors' ``batches`` of :func:`state_layout`, ``batch_size`` rows each)
    tells a late write from a lost one: a row holding position ``p`` where ``p +
    capacity`` was expected is accepted only if the write of ``p`` finished after the
    write of ``p + capacity`` began. Without them, a batch of the last lap whose write
    never landed leaves its rows holding the previous lap's positions, as late writes do.

    Example:
        >>> buffer = replay_layout(capacity=4)
        >>> buffer["index"][:] = torch.tensor([0, 1, 2, 3])  # slots 0..5: 0, 1 written after 4, 5
        >>> slots_check(buffer, reserved=6, written=6, late_rows=2)[0]
        True
        >>> slots_check(buffer, reserved=6, written=6, late_rows=1)
        (False, '2 rows hold the position one lap before the last one the cursor gave them: more than the 1 that late writes can leave')
    """
    if written != reserved:
        return False, f"the cursor reserved {reserved:,} slots but the actors wrote {written:,}"
    capacity = len(buffer)
    expected = expected_indices(reserved, capacity)
    held = buffer["index"]
    late = int(((held == expected - capacity) & (expected >= capacity)).sum())
    wrong = int((held != expected).sum()) - late
    if wrong:
        return False, f"{wrong:,} rows do not hold the last position the cursor gave them"
    if late and batches is not None:
        lost = _lost_rows(held, expected, capacity, batches, batch_size)
        if lost:
            return False, (f"{lost:,} rows hold the position one lap before the last one the cursor gave "
                           "them, but that earlier write had finished before the later one began: a lost write")
    allowed = capacity // 2 if late_rows is None else late_rows
    if late > allowed:
        return False, (f"{late:,} rows hold the position one lap before the last one the cursor gave "
                       f"them: more than the {allowed:,} that late writes can leave")
    message = f"reserved {reserved:,} slots = written {written:,}; every slot written exactly once"
    if late:
        message += (f" ({late:,} rows kept a write that finished after the next lap's: the cursor "
                    "orders reservations, not writes)")
    return True, message


def _lost_rows(held: torch.Tensor, expected: torch.Tensor, capacity: int, batches: torch.Tensor,
               batch_size: int) -> int:
    """How many rows hold the previous lap's position ``p`` (``expected - capacity``)
    though the batch that wrote ``p`` finished before the batch of ``expected`` began
    (or either batch is not in ``batches``)."""
    late = (held == expected - capacity) & (expected >= capacity)
    known = batches[batches[:, 0] >= 0]
    order = known[:, 0].argsort()
    starts, begun, done = known[order, 0], known[order, 1], known[order, 2]

    def batch_of(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = (torch.searchsorted(starts, positions, right=True) - 1).clamp(min=0)
        return at, (starts[at] <= positions) & (positions < starts[at] + batch_size)

    if not len(starts):
        return int(late.sum())
    at_later, later_found = batch_of(expected[late])
    at_earlier, earlier_found = batch_of(held[late])
    accepted = later_found & earlier_found & (done[at_earlier] > begun[at_later])
    return int((~accepted).sum())


def backing_inode(tensor: torch.Tensor) -> int:
    """The inode of the file or memfd that this process maps at ``tensor``'s address.

    Two processes that report the same inode read and write the same physical memory:
    the proof that nothing was copied. Linux only (``/proc/self/maps``).
    """
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                return int(fields[4])
    raise LookupError(f"address {address:#x} is not mapped in process {os.getpid()}")


def check_in(state: TensorDict, slot: int, buffer: TensorDict) -> CreatorWatch:
    """Report this worker ready (with the inode it maps the buffer from) and wait for
    the parent to start the run (``phase`` leaves 0). Returns the watch of the parent,
    for :func:`running`."""
    parent = CreatorWatch()  # (not os.getppid() now: the parent may be gone already)
    state["inode"][slot] = backing_inode(buffer["obs"])
    state["ready"][slot] = True
    while int(state["phase"]) == 0 and not parent.gone():
        time.sleep(0.01)
    return parent


def running(state: TensorDict, parent: CreatorWatch) -> bool:
    """Whether the run goes on: ``phase`` is 1 and the parent that would end it is alive
    (a SIGKILLed parent never sets phase 2: its workers must not outlive it)."""
    return int(state["phase"]) == 1 and not parent.gone()
