"""The actor/learner demo behind ``python -m shared_td demo``.

Actor processes write transitions into a replay buffer that a Coordinator publishes;
each reserves its rows with a :class:`shared_td.SharedCounter` cursor and writes them
in place. A learner process samples from the buffer, fits a reward model and publishes
new weights and a ``policy_version`` (a shared non-tensor value) that the actors read.

Modules: :mod:`~shared_td.demo.replay` (buffer layout, toy environment, checks),
:mod:`~shared_td.demo.actor`, :mod:`~shared_td.demo.learner`,
:mod:`~shared_td.demo.session` (starts, shows, stops, verifies) and
:mod:`~shared_td.demo.progress` (a dependency-free progress line).

Example:
    >>> from shared_td.demo import run_demo
    >>> run_demo(seconds=5, actors=2).ok              # doctest: +SKIP
    True
"""
from shared_td.demo.session import DemoResult, run_demo

__all__ = ["DemoResult", "run_demo"]
