"""Which tensorclass may be written into the rows of which: ``dest[idx] = value``
between two tensorclasses is allowed for the same class, or another class with the
same fields (or a plain tensordict), as in tensordict 0.15.3, at every depth of the
write: the tensorclass itself, and each tensorclass held in a tensordict or in
another tensorclass written so (``td[:2] = src[:2]`` where ``td["a"]`` is an ``A`` and
``src["a"]`` a ``B``). Without the check a ``B``'s extra fields would be added into the
``A`` instance as keys no field names.

Called by ``TensorClass.__setitem__`` (tensorclass_members.py) and by the general
index write of a TensorDict (index_writes.py), before anything is written.
"""
from __future__ import annotations

from typing import Any

from shared_td.keys import key_repr
from shared_td.tensorclass_protocol import is_tensorclass


def check_row_write(dest: Any, value: Any, path: tuple = (), fields_only: bool = False) -> None:
    """Raise ValueError if ``dest[idx] = value`` writes a tensorclass of another class
    with other fields into the tensorclass ``dest`` (any other pair passes). ``path``:
    where ``dest`` is in the tensordict written into, for the message. ``fields_only``:
    refuse only a source (a tensordict, a dict, a tensorclass of other fields) holding
    keys that are no field (the check made below a lazy stack).

    Example:
        >>> import torch
        >>> from shared_td import TensorClass
        >>> class A(TensorClass):
        ...     x: torch.Tensor
        >>> class B(TensorClass):
        ...     x: torch.Tensor
        ...     y: torch.Tensor
        >>> a, b = A(x=torch.zeros(2), batch_size=[2]), B(x=torch.ones(2), y=torch.ones(2), batch_size=[2])
        >>> check_row_write(a, A(x=torch.ones(2), batch_size=[2]))  # the same class: allowed
        >>> try:
        ...     check_row_write(a, b, ("obs",))
        ... except ValueError as error:
        ...     print(str(error)[:56])
        Cannot write a B into the rows of the A at key 'obs': __
    """
    if not is_tensorclass(dest) or isinstance(value, type(dest)):
        return
    if not is_tensorclass(value) or (fields_only and type(dest)._tc_field_names != type(value)._tc_field_names):
        # a tensordict (or dict) of keys that are no fields: they would be added into the
        # instance as keys no attribute reads (its copies and rows then lose the class),
        # which set() and update() refuse too (tensordict 0.15.3 adds them, then cannot
        # index or clone the tree); below a lazy stack, a tensorclass of other fields too
        from shared_td.containers.value_kinds import is_non_tensor, is_tensor_collection

        if isinstance(value, dict) or (is_tensor_collection(value) and not is_non_tensor(value)):
            extra = sorted(set(value.keys()) - type(dest)._tc_field_names, key=str)
            if extra:
                where = f" at key {key_repr(path)}" if path else ""
                raise ValueError(
                    f"Keys {extra} are not fields of {type(dest).__name__}{where} (its fields are "
                    f"{sorted(type(dest)._tc_field_names)}); nothing was written."
                )
        return
    mine, theirs = type(dest)._tc_field_names, type(value)._tc_field_names
    if mine == theirs:
        return
    where = f" at key {key_repr(path)}" if path else ""
    # (tensordict's wording follows, so that handlers matching on it still match)
    raise ValueError(
        f"Cannot write a {type(value).__name__} into the rows of the {type(dest).__name__}"
        f"{where}: __setitem__ is only allowed for same-class or compatible class (same "
        f"fields) assignment, or a tensordict. {type(dest).__name__} has fields "
        f"{sorted(mine)}, {type(value).__name__} has {sorted(theirs)}."
    )
