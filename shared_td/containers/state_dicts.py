"""``state_dict`` and ``load_state_dict``: a tensordict as torch's ``nn.Module`` state
dicts are (what torch.save checkpoints and torchrl's replay storages save), in tensordict
0.15.3's format, so that a state dict of either package loads into the other.

The format: an ``OrderedDict`` of the tensor leaves, flat by default (``"n.b"`` for
``("n", "b")``) or nested (``flatten=False``: an ``OrderedDict`` per nested tensordict),
whose ``_metadata`` attribute holds, per level (``""`` the root, ``"n"`` below it), the
batch size and device; a level that is a tensorclass adds ``"_type"`` (its class name)
and ``"_non_tensor"`` (its non-tensor fields), and a non-tensor entry is a level of its
own (``"_type": "NonTensorData"``, its value in ``"_non_tensor"``; a NonTensorStack's
values as a list under ``"data"``, which tensordict 0.15.3 leaves out). A lazy stack's
leaves are its stacked tensors.

``load_state_dict`` writes the leaves into the tensordict's own tensors (``assign=False``,
the default): a shared or memory-mapped tensordict takes the checkpoint in its segments
or files, which every process attached to it sees.
"""
from __future__ import annotations

import collections
from typing import Any

import torch

from shared_td.containers.value_kinds import is_lazy_stack, is_non_tensor, is_tensor_collection
from shared_td.errors import StateDictKeysError
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass

__all__ = ["StateDictOps", "load_state_dict", "state_dict_of"]

_SEP = "."


class StateDictOps:
    """Mixin of TensorDictBase."""

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                   flatten: bool = True) -> collections.OrderedDict:
        """The tensor leaves in an ``OrderedDict``, as ``torch.nn.Module.state_dict`` (and
        tensordict 0.15.3) give them: flat keys joined by ``"."`` (``flatten=False``: a
        nested ``OrderedDict`` per level), batch sizes, devices and non-tensor values in
        its ``_metadata`` (see the module's opening); detached unless ``keep_vars``.

        Raises:
            KeyError: with ``flatten=True``, two entries that would get one flat key
                (``"a.b"`` and ``("a", "b")``); ``flatten=False`` keeps them apart.

        Example:
            >>> sd = TensorDict(a=torch.zeros(2), n={"b": torch.ones(2)}, batch_size=[2]).state_dict()
            >>> list(sd), sd._metadata["n"]["batch_size"]
            (['a', 'n.b'], torch.Size([2]))
        """
        return state_dict_of(self, destination, prefix, keep_vars, flatten)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False,
                        from_flatten: bool | None = None) -> Any:
        """Load a ``state_dict`` (this package's or tensordict 0.15.3's, flat or nested)
        into this tensordict and return it: each leaf written into the tensor it has
        (``assign=True``: the state dict's tensors replace them), the batch sizes and
        non-tensor values set. ``strict``: the keys must be this tensordict's (a missing
        or extra key is a StateDictKeysError, both a RuntimeError and a KeyError, naming
        them, before anything is written).
        ``from_flatten``: None tells a flat state dict by its keys.

        Example:
            >>> td = TensorDict(a=torch.zeros(2), batch_size=[2])
            >>> td.load_state_dict(TensorDict(a=torch.ones(2), batch_size=[2]).state_dict())["a"].tolist()
            [1.0, 1.0]
        """
        return load_state_dict(self, state_dict, strict, assign, from_flatten)


def load_state_dict(node: Any, state_dict: Any, strict: bool, assign: bool, from_flatten: bool | None) -> Any:
    """``node.load_state_dict(...)`` (a tensordict, lazy stack or tensorclass)."""
    if from_flatten is None:  # (a flat one has a level per nested node, or keys of its own)
        levels = getattr(state_dict, "_metadata", None)
        from_flatten = levels is not None and (bool(set(levels) - {""})
                                               or set(state_dict) != set(unwrap_tensorclass(node).keys()))
    nested = _unflattened(state_dict) if from_flatten else state_dict
    _check_keys(node, nested, strict, ())
    _load(node, nested, assign)
    return node


def state_dict_of(node: Any, destination: Any, prefix: str, keep_vars: bool, flatten: bool) -> Any:
    """``node.state_dict(...)`` (a tensordict, lazy stack or tensorclass: a tensorclass's level is
    marked with its class name and its non-tensor fields, None ones included, as tensordict 0.15.3)."""
    if destination is None:
        destination = collections.OrderedDict()
    if not hasattr(destination, "_metadata"):
        destination._metadata = collections.OrderedDict()
    level = {"batch_size": node.batch_size, "device": node.device}
    entries = unwrap_tensorclass(node)
    if is_lazy_stack(entries):
        _refuse_exclusive_keys(entries, prefix)
    non_tensor = {}
    if is_tensorclass(node):
        level["_type"] = type(node).__name__
        non_tensor = {name: None for name in type(node)._tc_field_names if name not in entries.keys()}
    level_key = prefix[:-1] if prefix.endswith(_SEP) else prefix
    if prefix:
        _claim(destination, level_key)
    destination._metadata[level_key] = level
    for key in entries.keys():
        item = entries.get(key)
        if is_non_tensor(item) and is_tensorclass(node):
            non_tensor[key] = _value(item)
        elif is_non_tensor(item) and flatten:
            _claim(destination, prefix + key)
            destination._metadata[prefix + key] = _non_tensor_level(item)
        elif is_non_tensor(item):  # (its level in its own nested state dict only, as tensordict 0.15.3)
            _put(destination, prefix + key, _nested_level(_non_tensor_level(item)))
        elif is_tensor_collection(item):
            if flatten:
                state_dict_of(item, destination, prefix + key + _SEP, keep_vars, True)
            else:
                destination[prefix + key] = state_dict_of(item, None, "", keep_vars, False)
        else:
            _put(destination, prefix + key, item if keep_vars else item.detach())
    if is_tensorclass(node):  # (empty too, as tensordict 0.15.3 writes it)
        level["_non_tensor"] = non_tensor
    return destination


def _refuse_exclusive_keys(stack: Any, prefix: str) -> None:
    """A RuntimeError for a lazy stack whose members hold different keys, as tensordict 0.15.3:
    its state dict would leave the keys only some members hold out, in silence."""
    key_sets = [set(unwrap_tensorclass(member).keys()) for member in stack.tensordicts]
    only_some = set().union(*key_sets) - set.intersection(*key_sets) if key_sets else set()
    if only_some:
        where = f" at {prefix[:-1]!r}" if prefix else ""
        raise RuntimeError(f"Cannot take the state dict of the lazy stack{where}: the keys {sorted(only_some)} "
                           "are held by some of its members only, and a state dict holds the stack's leaves "
                           "(tensordict 0.15.3 refuses it too); take each member's state dict, or densify the stack "
                           "first.")


def _put(destination: Any, key: str, value: Any) -> None:
    _claim(destination, key)
    destination[key] = value


def _claim(destination: Any, key: str) -> None:
    """A KeyError when ``key`` names a leaf or a level already: two entries (a key holding
    the separator and a nested key) would share it, and the state dict would not load
    back (tensordict 0.15.3 refuses two leaves so, and writes a leaf and a level)."""
    if key in destination or key in destination._metadata:
        raise KeyError(f"Two entries of the tensordict get the flat state-dict key {key!r} (a key holding "
                       f"{_SEP!r} and a nested key): use state_dict(flatten=False) to keep them apart.")


def _value(item: Any) -> Any:
    return item.tolist() if is_lazy_stack(item) else item.data


def _non_tensor_level(item: Any) -> dict:
    from shared_td.containers.nontensor import NonTensorStack

    kind = "NonTensorStack" if isinstance(item, NonTensorStack) else "NonTensorData"
    return {"batch_size": item.batch_size, "device": item.device, "_type": kind,
            "_non_tensor": {"data": _value(item), "_metadata": None, "_is_non_tensor": True}}


def _nested_level(level: dict | None) -> collections.OrderedDict:
    """A nested state dict's level: an ``OrderedDict`` whose ``_metadata`` holds ``level``
    under ``""`` (None: nothing yet)."""
    out = collections.OrderedDict()
    out._metadata = collections.OrderedDict([] if level is None else [("", level)])
    return out


def _unflattened(flat: Any) -> collections.OrderedDict:
    """A flat state dict as nested ``OrderedDict``s, each with its level's ``_metadata``
    (a level with no leaf, a non-tensor entry, from its metadata alone)."""
    root = _nested_level(None)

    def level_at(parts: list) -> Any:
        node = root
        for part in parts:
            if part not in node:
                node[part] = _nested_level(None)
            node = node[part]
        return node

    for key, value in flat.items():
        parts = key.split(_SEP)
        level_at(parts[:-1])[parts[-1]] = value
    for key, level in getattr(flat, "_metadata", {}).items():
        level_at(key.split(_SEP) if key else [])._metadata[""] = level
    return root


def _level(state: Any) -> dict:
    return getattr(state, "_metadata", {}).get("", {})


def _check_keys(node: Any, state: Any, strict: bool, path: tuple) -> None:
    """With ``strict``, a StateDictKeysError (a RuntimeError and a KeyError) naming the
    keys that differ, before any write."""
    entries = unwrap_tensorclass(node)
    if not strict or is_non_tensor(entries):
        return
    theirs = set(state)
    if is_tensorclass(node):
        theirs |= set(_level(state).get("_non_tensor", {}))
    ours = set(entries.keys()) | (type(node)._tc_field_names if is_tensorclass(node) else set())
    empty = {key for key in ours - theirs if _is_empty_node(entries.get(key))}
    extra = {key for key in theirs - ours if _holds_nothing(state.get(key))}  # (levels with no leaf: nothing to load)
    if ours - theirs - empty or theirs - ours - extra:
        where = f" at {path!r}" if path else ""
        raise StateDictKeysError(f"Cannot load the state dict{where}: its keys are not the tensordict's (the "
                                 f"state dict lacks {sorted(ours - theirs - empty)} and has "
                                 f"{sorted(theirs - ours - extra)} more). Pass strict=False to load the keys it has. "
                                 "Nothing was written.")
    for key in theirs & ours:
        value = state[key] if key in state else None
        if isinstance(value, dict) and is_tensor_collection(entries.get(key)):
            _check_keys(entries.get(key), value, strict, path + (key,))


def _holds_nothing(state: Any) -> bool:
    """Whether a state dict level holds no leaf and no non-tensor value at any depth (an empty
    nested tensordict's levels, metadata alone): there is nothing to load from it, and tensordict
    0.15.3 neither refuses it (strict) nor adds it."""
    if not isinstance(state, dict):
        return False
    level = _level(state)
    if level.get("_type") in ("NonTensorData", "NonTensorStack") or level.get("_non_tensor"):
        return False
    return all(_holds_nothing(value) for value in state.values())


def _is_empty_node(value: Any) -> bool:
    return is_tensor_collection(value) and not is_non_tensor(value) and value.is_empty()


def _load(node: Any, state: Any, assign: bool) -> None:
    entries = unwrap_tensorclass(node)
    level = _level(state)
    if "batch_size" in level and not is_lazy_stack(entries):
        entries.batch_size = level["batch_size"]
    for name, value in level.get("_non_tensor", {}).items() if is_tensorclass(node) else ():
        current = entries.get(name, None)
        if value is None:  # (a field that is None holds no entry)
            if current is not None and not _reads_as_none(current):  # (a stored None is left: locked trees)
                setattr(node, name, None)
        else:
            _set_value(entries, name, current, value, assign)
    fields = type(node)._tc_field_names if is_tensorclass(node) else None
    for key, value in state.items():
        current = entries.get(key, None)
        if fields is not None and key not in fields and current is None:
            continue  # (strict=False: a key the class has no field for is not added, as in tensordict 0.15.3)
        if isinstance(value, dict):
            if current is None and _holds_nothing(value):
                continue  # (no leaf to load: not added, as in tensordict 0.15.3, so a locked tree loads it)
            inner = _level(value)
            if inner.get("_type") in ("NonTensorData", "NonTensorStack"):
                _set_value(entries, key, current, _non_tensor_value(inner), assign)
                continue
            if current is None:
                current = entries.empty()
                entries.set(key, current)
            _load(current, value, assign)
        else:
            entries.set(key, value, inplace=not assign and current is not None)


def _non_tensor_value(level: dict) -> Any:
    """A non-tensor level's value as the entry to write: a NonTensorData of its one value
    (a list too: one value, not one per element), or a NonTensorStack of the level's batch
    size from its values (nested lists, one level per batch dim; values that are lists
    themselves are not read as more dims)."""
    from shared_td.containers.nontensor import NonTensorData, NonTensorStack

    data = level["_non_tensor"]["data"]
    if "batch_size" not in level:
        return data
    shape = torch.Size(level["batch_size"])
    if level.get("_type") != "NonTensorStack":
        return NonTensorData(data, batch_size=shape, device=level.get("device"))
    flat = [data]
    for size in shape:
        if not all(isinstance(item, list) and len(item) == size for item in flat):
            return data  # (not nested as the batch size says: left to the write's own checks)
        flat = [value for item in flat for value in item]
    return NonTensorStack._from_flat(flat, shape, level.get("device"))


def _reads_as_none(value: Any) -> bool:
    """Whether a non-tensor entry holds None for every element: tensordict 0.15.3's state
    dict records such a NonTensorStack field as None, which is then no order to drop it."""
    if not is_non_tensor(value):
        return False
    pending = [value.tolist()]
    while pending:
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(item)
        elif item is not None:
            return False
    return True


def _set_value(entries: Any, key: str, current: Any, value: Any, assign: bool) -> None:
    if current is not None and not assign:
        entries.set_(key, value)  # (in place, as the leaves: a shared or memory-mapped value's readers see it)
    elif is_non_tensor(value) or isinstance(value, list):  # (an entry, or a NonTensorStack's values, one per element)
        entries.set(key, value)
    else:
        entries.set_non_tensor(key, value)  # (set() would read a dict as a nested tensordict, a number as a tensor)
