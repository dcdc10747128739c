"""The libraries compared: shared_td always, tensordict when it is installed.

tensordict is a test and benchmark dependency only, so it is imported here, lazily,
and its columns are left out (with a note) when it is missing.

Examples:
    >>> sorted(libraries())  # with tensordict installed
    ['shared_td', 'tensordict']
"""
from __future__ import annotations

import torch

#: The version the comparison is meant for (the format and API shared_td mirrors).
TENSORDICT_VERSION = "0.15.3"


def tensordict_module():
    """The tensordict module, or None when it is not installed."""
    try:
        import tensordict
    except ImportError:
        return None
    return tensordict


def libraries() -> dict:
    """name -> module, for every library with a TensorDict to compare."""
    import shared_td

    found = {"shared_td": shared_td}
    tensordict = tensordict_module()
    if tensordict is not None:
        found["tensordict"] = tensordict
    return found


def comparison_note() -> str | None:
    """A line for the table's header when the tensordict column is missing or off."""
    tensordict = tensordict_module()
    if tensordict is None:
        return (f"note: tensordict is not installed, so its columns are left out "
                f"(pip install tensordict=={TENSORDICT_VERSION} to compare)")
    version = getattr(tensordict, "__version__", "?")
    if version != TENSORDICT_VERSION:
        return f"note: tensordict {version} is installed; the comparison is meant for {TENSORDICT_VERSION}"
    return None


def build_tree(lib, nodes: int):
    """``nodes`` nested tensordicts of 2 small leaves each, built with ``lib``'s TensorDict."""
    return lib.TensorDict(
        {f"node{i}": {"obs": torch.randn(4), "reward": torch.randn(4)} for i in range(nodes)},
        batch_size=[4],
    )
