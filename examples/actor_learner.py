"""Actors write into a shared replay buffer, a learner trains from it: no copies.

The pattern, in four steps:

1. A ``Coordinator`` publishes the replay buffer (a memory-mapped TensorDict used as a
   ring of CAPACITY rows) and a small ``state`` TensorDict published with
   ``share_non_tensor=True``, whose ``policy_version`` is a non-tensor value that every
   process reads and the learner bumps.
2. Each actor process attaches both *by name* and gets tensordicts over the same memory.
3. An actor reserves rows with a ``SharedCounter`` -- ``start = cursor.fetch_add(BATCH)``
   hands positions ``start .. start + BATCH - 1`` to this actor alone -- and writes
   ``buffer[rows] = transitions`` in place.
4. The learner samples rows from the filled part of the buffer, fits a linear model of
   the reward, and publishes a new policy version with ``state.set_``.

Run:  python examples/actor_learner.py --seconds 10 --actors 2
A richer version (zero-copy proof, learned policy) is ``python -m shared_td demo``.
"""
from __future__ import annotations

import argparse
import multiprocessing
import time

import torch

from shared_td import Coordinator, NonTensorData, SharedCounter, TensorDict
from shared_td.demo.progress import ProgressLine, rate  # a tiny dependency-free progress line
from shared_td.demo.replay import slots_check  # every reserved slot written exactly once?

CAPACITY = 1 << 16   # rows of the ring buffer
BATCH = 64           # transitions an actor writes at once
OBS = 4              # observation size
TRUE_WEIGHTS = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5])  # hidden: reward = [obs, action] . w


def actor(coord: Coordinator, cursor: SharedCounter, actor_id: int) -> None:
    buffer = coord.attach("replay")  # the same memory as in every other process
    state = coord.attach("state")
    state["ready"][actor_id] = True
    obs = torch.randn(BATCH, OBS)
    while not state["stop"]:
        action = torch.randint(2, (BATCH,))
        features = torch.cat([obs, action[:, None].float()], dim=1)
        reward = features @ TRUE_WEIGHTS + 0.1 * torch.randn(BATCH)
        next_obs = torch.randn(BATCH, OBS)
        start = cursor.fetch_add(BATCH)  # positions start .. start+BATCH-1 are ours alone
        index = torch.arange(start, start + BATCH)
        buffer[index % CAPACITY] = TensorDict(  # written in place, into shared memory
            obs=obs, action=action, reward=reward, next_obs=next_obs,
            done=torch.rand(BATCH) < 0.05, index=index,
            policy_version=torch.full((BATCH,), state["policy_version"]),
            batch_size=[BATCH],
        )
        state["written"][actor_id] += BATCH  # each actor owns its counter: no race
        obs = next_obs
        time.sleep(0.002)  # a real actor would be stepping an environment here


def learner(coord: Coordinator, cursor: SharedCounter, slot: int) -> None:
    buffer = coord.attach("replay")
    state = coord.attach("state")
    weights = torch.zeros(OBS + 1, requires_grad=True)  # a linear model of the reward
    state["ready"][slot] = True
    updates = 0
    while not state["stop"]:
        filled = min(cursor.value, CAPACITY)  # rows [0, filled) have been reserved
        if filled == 0:
            time.sleep(0.01)
            continue
        batch = buffer[torch.randint(filled, (256,))]  # copies only the sampled rows
        batch = batch[batch["index"] >= 0]  # drop rows reserved but not yet written
        features = torch.cat([batch["obs"], batch["action"][:, None].float()], dim=1)
        loss = torch.nn.functional.mse_loss(features @ weights, batch["reward"])
        loss.backward()
        with torch.no_grad():  # plain SGD (torch.optim would add a cache dir to /tmp)
            weights -= 0.05 * weights.grad
            weights.grad = None
        updates += 1
        state["sampled"].add_(len(batch))
        state["loss"].fill_(loss.item())
        if updates % 50 == 0:
            state.set_("policy_version", updates // 50)  # a shared non-tensor: actors see it
        time.sleep(0.001)


def wait_until(condition, workers, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(w.exitcode is not None for w in workers):
            raise SystemExit("a worker failed to start (see its traceback above)")
        time.sleep(0.05)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--actors", type=int, default=2)
    args = parser.parse_args(argv)

    with Coordinator() as coord:
        buffer = coord.publish("replay", TensorDict(
            obs=torch.zeros(CAPACITY, OBS), action=torch.zeros(CAPACITY, dtype=torch.int64),
            reward=torch.zeros(CAPACITY), next_obs=torch.zeros(CAPACITY, OBS),
            done=torch.zeros(CAPACITY, dtype=torch.bool),
            index=torch.full((CAPACITY,), -1),  # the cursor position of each row's data
            policy_version=torch.zeros(CAPACITY, dtype=torch.int64),
            batch_size=[CAPACITY],
        ))
        state = coord.publish("state", TensorDict(
            policy_version=NonTensorData(0), stop=torch.tensor(False),
            ready=torch.zeros(args.actors + 1, dtype=torch.bool),
            written=torch.zeros(args.actors, dtype=torch.int64),
            sampled=torch.tensor(0), loss=torch.tensor(0.0),
        ), share_non_tensor=True)
        cursor = SharedCounter()

        ctx = multiprocessing.get_context("spawn")  # the strictest start method
        workers = [ctx.Process(target=actor, args=(coord, cursor, i)) for i in range(args.actors)]
        workers.append(ctx.Process(target=learner, args=(coord, cursor, args.actors)))
        for worker in workers:
            worker.start()
        try:
            wait_until(lambda: bool(state["ready"].all()), workers, timeout=120)
            line = ProgressLine()
            started, written0, sampled0 = time.monotonic(), int(state["written"].sum()), int(state["sampled"])
            while (elapsed := time.monotonic() - started) < args.seconds:
                written = int(state["written"].sum()) - written0
                sampled = int(state["sampled"]) - sampled0
                line.update(elapsed / args.seconds, f"written {rate(written, elapsed)}  "
                            f"sampled {rate(sampled, elapsed)}  policy v{state['policy_version']}")
                time.sleep(0.2)
            line.close()
            # the timed window ends here: what the workers do while stopping is not in it
            elapsed = time.monotonic() - started
            written_now = int(state["written"].sum()) - written0
            sampled_now = int(state["sampled"]) - sampled0
        finally:
            state["stop"].fill_(True)
            deadline = time.monotonic() + 30  # one deadline for all of them, then kill
            for worker in workers:
                worker.join(max(deadline - time.monotonic(), 0))
            for worker in workers:
                if worker.exitcode is None:
                    worker.kill()  # SIGKILL: a stuck worker too
                    worker.join(10)
        written = int(state["written"].sum())
        ok, message = slots_check(buffer, cursor.value, written)
        print(f"throughput: {args.actors} actors wrote {written_now:,} transitions "
              f"({rate(written_now, elapsed)}), the learner sampled {sampled_now:,} "
              f"({rate(sampled_now, elapsed)}); loss {float(state['loss']):.4f}, "
              f"policy version {state['policy_version']}")
        # the cursor counts every write of the run, the timed ones and the others
        print(f"cursor: {message} ({written:,} = {written_now:,} in the {elapsed:.1f} s timed "
              f"above + {written - written_now:,} while the workers started and stopped)")
    return 0 if ok and all(w.exitcode == 0 for w in workers) else 1


if __name__ == "__main__":
    raise SystemExit(main())
