"""Actors write into a replay buffer that the learner reads, with no copies.

The buffer is a TensorDict whose leaves are anonymous MemoryMappedTensors (shared memory
with no file name). Each actor process gets the buffer by reference: pickling a
MemoryMappedTensor sends a handle to the same memory, never the bytes. The actors write
their rows with ``buffer[rows] = TensorDict(...)`` (the replay-buffer write), and the
learner sees the writes at once.

Run:  python examples/shared_buffer.py
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import time

import torch

from shared_td import MemoryMappedTensor, TensorDict

ROWS_PER_ACTOR = 64
OBS_SIZE = 8


def actor(buffer: TensorDict, actor_id: int) -> None:
    """Fill this actor's rows of the shared buffer."""
    rows = slice(actor_id * ROWS_PER_ACTOR, (actor_id + 1) * ROWS_PER_ACTOR)
    steps = torch.arange(ROWS_PER_ACTOR)
    buffer[rows] = TensorDict(
        {
            "obs": torch.full((ROWS_PER_ACTOR, OBS_SIZE), float(actor_id)),
            "reward": steps.float() / ROWS_PER_ACTOR,
            "done": steps == ROWS_PER_ACTOR - 1,
            "info": {"actor": torch.full((ROWS_PER_ACTOR,), actor_id)},
        },
        batch_size=[ROWS_PER_ACTOR],
    )


def main(num_actors: int = 2, start_method: str = "spawn") -> TensorDict:
    capacity = num_actors * ROWS_PER_ACTOR
    layout = TensorDict(
        {
            "obs": torch.zeros(capacity, OBS_SIZE),
            "reward": torch.zeros(capacity),
            "done": torch.zeros(capacity, dtype=torch.bool),
            "info": {"actor": torch.full((capacity,), -1)},
        },
        batch_size=[capacity],
    )
    # Every leaf becomes an anonymous MemoryMappedTensor; the tensordict is locked so
    # that workers can only write in place.
    buffer = layout.apply(MemoryMappedTensor.from_tensor).lock_()

    context = mp.get_context(start_method)
    started = time.perf_counter()
    actors = [context.Process(target=actor, args=(buffer, i)) for i in range(num_actors)]
    for process in actors:
        process.start()
    for process in actors:
        process.join(timeout=120)
        if process.exitcode != 0:
            raise SystemExit(f"actor {process.name} failed with exit code {process.exitcode}")
    elapsed = time.perf_counter() - started

    per_actor = buffer["info", "actor"].reshape(num_actors, ROWS_PER_ACTOR)
    assert (per_actor == torch.arange(num_actors)[:, None]).all(), "an actor's rows are missing"
    assert int(buffer["done"].sum()) == num_actors
    print(buffer)
    print(
        f"{num_actors} {start_method} actors wrote {capacity} rows into shared memory in "
        f"{elapsed:.2f}s; the learner sees mean reward {buffer['reward'].mean():.3f} and "
        f"{int(buffer['done'].sum())} episode ends."
    )
    return buffer


if __name__ == "__main__":
    main(start_method=sys.argv[1] if len(sys.argv) > 1 else "spawn")
