"""The actor processes of the demo: act in an environment and write transitions into
the shared replay buffer, in place.

:func:`run_actor` (one node) reserves its rows from the shared cursor itself;
:func:`run_node_actor` (``--nodes 2``, an actor on a replica node) writes the rows its
node's agent granted it from the cluster-wide cursor, into the node's replica of the
buffer, and the agent pushes them to the learner's node.

Nothing an actor writes travels through a pipe or a coordinator: ``buffer[rows] = batch``
stores straight into the memory every process of its node maps.
"""
from __future__ import annotations

import time

import torch

from shared_td import Coordinator, SharedCounter, TensorDict
from shared_td.demo.replay import Env, check_in, greedy_actions, ring_rows, running
from shared_td.demo.supervise import ignore_ctrl_c

EPSILON = 0.2  # exploration rate


def _warm_up(buffer, batch_size: int) -> None:
    # The first indexed write imports parts of torch (~0.5 s): pay for it on a private
    # copy before reporting ready, so the measured run starts at full speed.
    scratch = buffer[:batch_size].clone()
    scratch[torch.arange(batch_size)] = scratch.clone()


def write_step(buffer, env: Env, weights, version: int, start: int) -> float:
    """Act once in ``env`` with the policy ``weights`` (of ``version``) and write the
    transitions at cursor positions ``start ..`` of ``buffer``; returns their mean
    reward. The learner may be rewriting the weights meanwhile: a policy that acts on a
    half-updated model is harmless, and reading it costs no copy."""
    batch_size = env.batch_size
    action = greedy_actions(weights, env.obs, EPSILON, env.generator)
    transitions = env.step(action)
    buffer[ring_rows(start, batch_size, len(buffer))] = TensorDict(
        transitions,
        index=torch.arange(start, start + batch_size),
        policy_version=torch.full((batch_size,), version),
        batch_size=[batch_size],
    )
    return float(transitions["reward"].mean())


def run_actor(coord: Coordinator, cursor: SharedCounter, actor_id: int, batch_size: int,
              pause: float, tickets: SharedCounter | None = None) -> None:
    """Write ``batch_size`` transitions per step until the parent sets ``phase`` to 2.

    With ``tickets`` (and the state's ``batches``), each batch takes a ticket before its
    write and one after, recorded with its cursor start: the order of the writes, which
    the cursor (the order of the reservations) does not give, so that the slot check
    tells a late write from a lost one.

    Spawn-safe: everything arrives by reference (the coordinator handle is its address
    and key; the counters memfd references) and the buffer is attached by name.
    """
    ignore_ctrl_c()  # Ctrl-C: the parent stops us via phase
    buffer = coord.attach("replay")
    state = coord.attach("state")
    env = Env(batch_size, seed=1 + actor_id)
    _warm_up(buffer, batch_size)
    parent = check_in(state, actor_id, buffer)
    mean_reward = 0.0
    history = state["batches"][actor_id] if tickets is not None and "batches" in state.keys() else None
    steps = 0
    while running(state, parent):
        version = state["policy_version"]  # a shared non-tensor value
        start = cursor.fetch_add(batch_size)  # these positions are ours alone
        begun = tickets.fetch_add(1) if history is not None else -1
        reward = write_step(buffer, env, state["weights"], version, start)
        if history is not None:  # (before ``written``: a counted batch is recorded)
            history[steps % len(history)] = torch.tensor([start, begun, tickets.fetch_add(1)])
            steps += 1
        state["written"][actor_id] += batch_size
        mean_reward = 0.95 * mean_reward + 0.05 * reward
        state["mean_reward"][actor_id] = mean_reward
        time.sleep(pause)  # leave CPU to the other processes of a small machine


def run_node_actor(coord: Coordinator, actor_id: int, batch_size: int, pause: float) -> None:
    """An actor on a replica node: attaches its node's replicas of ``replay`` and
    ``policy`` and the node's ``actors`` state through its node's coordinator (never the
    network), then, until ``phase`` is 2, writes ``batch_size`` transitions at each
    cursor position ``grant[actor_id]`` the node's agent hands it and reports the
    position done in ``filled[actor_id]``."""
    ignore_ctrl_c()  # Ctrl-C: the agent stops us via phase
    buffer = coord.attach("replay")
    policy = coord.attach("policy")
    state = coord.attach("actors")
    env = Env(batch_size, seed=1 + actor_id)
    _warm_up(buffer, batch_size)
    parent = check_in(state, actor_id, buffer)
    grant, filled = state["grant"], state["filled"]
    mean_reward = 0.0
    while running(state, parent):
        start = int(grant[actor_id])
        if start < 0 or start == int(filled[actor_id]):
            time.sleep(0.0005)  # the agent is pushing our last rows
            continue
        reward = write_step(buffer, env, policy["weights"], int(policy["version"]), start)
        filled[actor_id] = start  # after the rows: the agent pushes them now
        mean_reward = 0.95 * mean_reward + 0.05 * reward
        state["mean_reward"][actor_id] = mean_reward
        time.sleep(pause)
