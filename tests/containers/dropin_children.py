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
