"""Child-process functions of test_consolidate.py (a helper module, not a test)."""
from __future__ import annotations

import pickle


def add_one_and_report(td, answers) -> None:
    """Add 1 to every leaf of the (shared) consolidated ``td`` and report whether it
    arrived consolidated and which segment its leaves are in."""
    for leaf in td.values(include_nested=True, leaves_only=True):
        leaf.add_(1)
    segments = {leaf._backing.key for leaf in td.values(include_nested=True, leaves_only=True)}
    answers.put((td.is_consolidated(), sorted(segments)))


def unpickle_and_sum(connection) -> None:
    """Receive a pickled tensordict over ``connection``, answer the sum of its leaves."""
    td = pickle.loads(connection.recv_bytes())
    total = sum(float(leaf.double().sum()) for leaf in td.values(include_nested=True, leaves_only=True))
    connection.send((td.is_consolidated(), total))
