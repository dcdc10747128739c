"""Leaves whose bytes cannot be memory-mapped, refused by their key before a write.

torch's own errors for them ("Cannot copy out of meta tensor; no data!", "nbytes is not
defined for sparse tensors") name no key, and came from the middle of a write.
"""
from __future__ import annotations

import torch

from shared_td.keys import key_repr
from shared_td.persist.planner import NodePlan


def check_leaf_layouts(root: NodePlan, path: tuple = ()) -> None:
    """Refuse, naming its key, a planned leaf whose bytes cannot be written: one on the
    meta device (it has none) or not dense (sparse). Called on the plan, before
    anything is written (torch's own errors name no key).

    Example:
        >>> import torch, shared_td
        >>> from shared_td.persist.planner import Options, Planner
        >>> td = shared_td.TensorDict(a=torch.zeros(2), b=torch.zeros(2).to_sparse())
        >>> check_leaf_layouts(Planner(Options(prefix=None, inplace=False)).plan(td))
        Traceback (most recent call last):
        ...
        RuntimeError: Key 'b': a torch.sparse_coo tensor cannot be memory-mapped (only dense, strided tensors can). Convert it with .to_dense() first.
    """
    for key, leaf in root.leaves.items():
        source = leaf.source
        if source.is_meta:
            raise NotImplementedError(
                f"Key {key_repr(path + (key,))}: a tensor on the meta device has no data to "
                "memory-map. Give it data first (e.g. torch.zeros_like(tensor, device='cpu')).")
        if source.layout is not torch.strided:
            raise RuntimeError(
                f"Key {key_repr(path + (key,))}: a {source.layout} tensor cannot be memory-mapped "
                "(only dense, strided tensors can). Convert it with .to_dense() first.")
    for key, child in root.children.items():
        check_leaf_layouts(child, path + (key,))
