"""The learner process of the demo: samples batches from the filled part of the shared
replay buffer, fits a linear reward model, and publishes new weights and a new
``policy_version`` for the actors.
"""
from __future__ import annotations

import time

import torch

from shared_td import Coordinator, SharedCounter
from shared_td.demo.replay import NUM_ACTIONS, OBS_SIZE, check_in, running
from shared_td.demo.supervise import ignore_ctrl_c

LEARNING_RATE = 0.05


def run_learner(coord: Coordinator, cursor: SharedCounter, learner_slot: int, batch_size: int,
                publish_every: int, pause: float) -> None:
    """Train until the parent sets ``phase`` to 2; ``learner_slot`` is this process's
    index in ``state["ready"]`` and ``state["inode"]``."""
    ignore_ctrl_c()  # Ctrl-C: the parent stops us via phase
    buffer = coord.attach("replay")
    state = coord.attach("state")
    capacity = len(buffer)
    weights = torch.zeros(NUM_ACTIONS, OBS_SIZE, requires_grad=True)
    generator = torch.Generator().manual_seed(12345)
    parent = check_in(state, learner_slot, buffer)
    updates = 0
    while running(state, parent):
        filled = min(cursor.value, capacity)
        if filled == 0:
            time.sleep(0.01)
            continue
        # Reading copies only the sampled rows. A row reserved but not yet written
        # still holds index -1 and is dropped; one being overwritten may mix two
        # transitions, which a replay buffer tolerates.
        batch = buffer[torch.randint(filled, (batch_size,), generator=generator)]
        batch = batch[batch["index"] >= 0]
        if len(batch) == 0:
            continue
        predicted = (weights[batch["action"]] * batch["obs"]).sum(-1)
        loss = torch.nn.functional.mse_loss(predicted, batch["reward"])
        loss.backward()
        with torch.no_grad():  # plain SGD: torch.optim would leave a cache dir in /tmp
            weights -= LEARNING_RATE * weights.grad
            weights.grad = None
        updates += 1
        state["sampled"].add_(len(batch))
        state["updates"].fill_(updates)
        state["loss"].fill_(loss.item())
        if updates % publish_every == 0:
            state["weights"].copy_(weights.detach())          # in place: the actors see it
            state.set_("policy_version", updates // publish_every)  # a shared non-tensor
        time.sleep(pause)
