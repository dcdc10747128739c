"""Naming the non-tensor entry whose value cannot be pickled.

A non-tensor value that is not stored as JSON is pickled (a save's other.pickle, or the
shared cell of share_memory_() and share_non_tensor=True); pickle's own error names the
value's type but not its key, and the code that pickles it never sees the key, so the
key is found here: :func:`check_picklable` before anything is done (a call that shares
node by node would otherwise leave the nodes before it changed), or
:func:`naming_unpicklable` around a call, re-raising its pickling error with the key.

One rule, whatever pickle raised (a TypeError for a lock, a PicklingError or an
AttributeError for a lambda, by Python version): the error is a TypeError naming the full
key, pickle's own error chained as its ``__cause__``, so that one ``except TypeError``
catches every such value (an in-place write into a shared or memory-mapped entry raises
the same, from NonTensorBase._check_storable).
"""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Iterator

import torch

from shared_td.containers.value_kinds import on_cuda
from shared_td.keys import key_repr
from shared_td.persist import format as fmt
from shared_td.storage.shared_value import share_together
from shared_td.tensorclass_protocol import unwrap_tensorclass

__all__ = ["check_picklable", "naming_unpicklable", "share_values_together"]


def check_picklable(obj: Any, action: str, *, shared: bool) -> None:
    """Raise a TypeError, naming its nested key, for the first non-tensor value of
    ``obj`` that cannot be pickled (``shared``: among those not in a shared cell yet;
    else among those that are not JSON values).

    Example:
        >>> td = TensorDict(batch_size=[])
        >>> td["f"] = NonTensorData(lambda: 1)
        >>> try:
        ...     check_picklable(td, "save", shared=False)
        ... except TypeError as error:
        ...     print(str(error)[:42], type(error.__cause__).__name__ in ("AttributeError", "PicklingError"))
        save: the non-tensor entry 'f' holds a fun True
    """
    found = _unpicklable(obj, shared)
    if found is not None:
        raise _unpicklable_error(action, found, shared) from found[2]


@contextlib.contextmanager
def naming_unpicklable(obj: Any, action: str, shared: bool) -> Iterator[None]:
    """Re-raise a pickling error of the block as a TypeError naming the entry at fault,
    the error chained (only when an entry is found whose own error the raised one
    carries: any other error passes as it is)."""
    try:
        yield
    except (TypeError, pickle.PicklingError, AttributeError) as error:
        found = _unpicklable(obj, shared)
        if found is None or str(found[2]) not in str(error):
            raise
        named = _unpicklable_error(action, found, shared)
        for note in getattr(error, "__notes__", ()):  # (what a failed clean-up added, say)
            named.add_note(note)
        raise named from error


def share_values_together(obj: Any) -> None:
    """Put every non-tensor value of ``obj`` not in a shared cell yet into cells of one
    memfd (``share_memory_()`` of a tree: one descriptor for its values, not one each);
    not those of a tensordict on a CUDA device (its ``share_memory_()`` leaves it as it is)."""
    share_together([entry for _path, entry in _non_tensor_entries(obj, on_cuda_node=False)])


def _non_tensor_entries(obj: Any, path: tuple = (), *, on_cuda_node: bool = True) -> Any:
    """(nested key, NonTensorData/NonTensorStack) of every non-tensor entry of ``obj``
    (``on_cuda_node=False``: none of a tensordict whose device is CUDA)."""
    if getattr(obj, "_is_non_tensor", False):
        yield path, obj
        return
    node = unwrap_tensorclass(obj)
    if not on_cuda_node and on_cuda(getattr(node, "_device", None)):
        return
    members = getattr(node, "tensordicts", None)
    if members is not None:  # a lazy stack: its members hold the entries, under the same keys
        for member in members:
            yield from _non_tensor_entries(member, path, on_cuda_node=on_cuda_node)
        return
    for key, value in getattr(node, "_tensordict", {}).items():
        if not isinstance(value, torch.Tensor):
            yield from _non_tensor_entries(value, path + (key,), on_cuda_node=on_cuda_node)


def _unpicklable(obj: Any, shared: bool) -> tuple | None:
    """(key, value, pickle's error) of the first non-tensor value that cannot be pickled
    (``shared``: of those not in a shared cell yet), or None."""
    for path, entry in _non_tensor_entries(obj):
        if shared and getattr(entry, "_shared_value", None) is not None:
            continue  # in a cell already: shared as it is
        data = entry.data
        if not shared and fmt.is_json_value(data):
            continue  # written in meta.json, never pickled
        try:
            pickle.dumps(data)
        except Exception as error:  # pickle raises TypeError, PicklingError, AttributeError...
            return path, data, error
    return None


def _unpicklable_error(action: str, found: tuple, shared: bool) -> TypeError:
    path, data, error = found
    purpose = "shared between processes" if shared else "written to a file"
    where = f"the non-tensor entry {key_repr(path)}" if path else "this non-tensor value"
    remedy = f"Remove it (del td[{path!r}]) or replace it" if path else "Replace it"
    message = (
        f"{action}: {where} holds a {type(data).__name__}, which cannot be pickled "
        f"({error}), so it cannot be {purpose}; nothing was done. {remedy} with a "
        "picklable value first."
    )
    return TypeError(message)
