"""Child-process targets of tests/containers/test_dropin.py.

A module of its own, importable by name, so that spawn children (which import the
target instead of inheriting it) find it.
"""
from __future__ import annotations


def write_non_tensor(td, key, value, done) -> None:
    """``td.set_(key, value)`` in the child, then tell the parent."""
    td.set_(key, value)
    done.put("written")


def write_stack_element(td, index, value, done) -> None:
    """``td[index] = {"st": value}``: one element of a shared NonTensorStack."""
    td[index] = {"st": value}
    done.put("written")


def update_entries(td, done) -> None:
    """``update_`` on the NonTensorData "s" and the NonTensorStack "st" themselves."""
    from shared_td import NonTensorData, NonTensorStack

    td.get("s").update_(NonTensorData("new", batch_size=[2]))
    td.get("st").update(NonTensorStack("c", "d"), inplace=True)
    done.put("written")


class StepDataset:
    """A dataset of one tensordict per index (``lib``: shared_td or tensordict), as a
    DataLoader's workers read it: collated by torch's default_collate."""

    def __init__(self, lib_name: str, rows: int):
        self.lib_name, self.rows = lib_name, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int):
        import importlib

        import torch

        lib = importlib.import_module(self.lib_name)
        return lib.TensorDict(obs=torch.full((3,), float(index)), reward=torch.tensor(index), task=f"t{index}")


class BatchDataset(StepDataset):
    """The same, whose ``__getitems__`` reads a whole batch in one index operation."""

    def __getitems__(self, indices: list):
        import torch

        return torch.stack([self[index] for index in indices])


def write_non_tensor_through_row(td, key, value, done) -> None:
    """``td[1].set_(key, value)`` in the child, then tell the parent."""
    td[1].set_(key, value)
    done.put("written")
