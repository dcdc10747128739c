"""An actor process of the demo: acts in its environment and writes transitions into
the shared replay buffer, in place, at rows reserved from the shared cursor.

Nothing it writes travels through a pipe or the coordinator: ``buffer[rows] = batch``
stores straight into the memory every process maps.
"""
from __future__ import annotations

import signal
import time

import torch

from shared_td import Coordinator, SharedCounter, TensorDict
from shared_td.demo.replay import Env, check_in, greedy_actions, ring_rows

EPSILON = 0.2  # exploration rate


def run_actor(coord: Coordinator, cursor: SharedCounter, actor_id: int, batch_size: int,
              pause: float) -> None:
    """Write ``batch_size`` transitions per step until the parent sets ``phase`` to 2.

    Spawn-safe: everything arrives by reference (the coordinator handle is its address
    and key; the cursor a memfd reference) and the buffer is attached by name.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops us via phase
    buffer = coord.attach("replay")
    state = coord.attach("state")
    capacity = len(buffer)
    env = Env(batch_size, seed=1 + actor_id)
    # The first indexed write imports parts of torch (~0.5 s): pay for it on a private
    # copy before reporting ready, so the measured run starts at full speed.
    scratch = buffer[:batch_size].clone()
    scratch[torch.arange(batch_size)] = scratch.clone()
    check_in(state, actor_id, buffer)
    mean_reward = 0.0
    while int(state["phase"]) == 1:
        # The learner may be rewriting the weights meanwhile; a policy that acts on a
        # half-updated model is harmless, and reading it costs no copy.
        action = greedy_actions(state["weights"], env.obs, EPSILON, env.generator)
        version = state["policy_version"]  # a shared non-tensor value
        transitions = env.step(action)
        start = cursor.fetch_add(batch_size)  # these positions are ours alone
        buffer[ring_rows(start, batch_size, capacity)] = TensorDict(
            transitions,
            index=torch.arange(start, start + batch_size),
            policy_version=torch.full((batch_size,), version),
            batch_size=[batch_size],
        )
        state["written"][actor_id] += batch_size
        mean_reward = 0.95 * mean_reward + 0.05 * float(transitions["reward"].mean())
        state["mean_reward"][actor_id] = mean_reward
        time.sleep(pause)  # leave CPU to the other processes of a small machine
