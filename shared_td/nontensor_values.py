"""Python values of non-tensor entries, free of any container: whether two are equal,
whether the values of a stack are one stacked NonTensorData, and the flat C-order list of
values that a NonTensorStack keeps versus the nested lists its users see.
"""
from __future__ import annotations

from typing import Any


def same_value(a: Any, b: Any) -> bool:
    """Whether two non-tensor values are equal (element-wise ones: everywhere); False
    when they cannot be compared."""
    if a is b:
        return True
    try:
        same = a == b
        return bool(same.all()) if hasattr(same, "all") else bool(same)
    except Exception:  # noqa: BLE001 - values of foreign types: not equal
        return False


def identical_value(a: Any, b: Any) -> bool:
    """Whether writing ``a`` over ``b`` changes nothing: the same object, or equal values
    of one type (an ``==`` that gives no bool, as arrays', counts as different; unlike
    :func:`same_value`, ``1 == 1.0`` and ``True == 1`` count as different too)."""
    try:
        return a is b or (type(a) is type(b) and bool(a == b))
    except Exception:  # noqa: BLE001 - an == that raises: different
        return False


def one_member(members: list | None, values: list, ndim: int) -> bool:
    """True if ``values`` (``ndim`` dims) are all of one stacked NonTensorData, with no
    dim of the stack left: then they are that NonTensorData (or a part of it). Their
    values are compared too, so a value written since (e.g. by another process into a
    shared stack) never hides behind one."""
    if not members or members[0] is None or any(m != members[0] for m in members):
        return False
    if ndim > members[0][1]:
        return False
    first = values[0]
    return all(identical_value(v, first) for v in values)  # (arrays: kept as a stack)


def nested_shape(values: Any) -> tuple[list[int], list]:
    """Shape and flat values of nested lists; ragged inner lists are kept as values.

    Only lists nest: a tuple inside is one value (``[("a", 1), ("b", 2)]`` has shape
    ``[2]``), as tensordict 0.15.3 keeps it; the outer sequence may be either."""
    if not isinstance(values, (list, tuple)):
        return [], [values]
    return _list_shape(list(values))


def _list_shape(values: Any) -> tuple[list[int], list]:
    if not isinstance(values, list):
        return [], [values]
    parts = [_list_shape(v) for v in values]
    inner = {tuple(shape) for shape, _ in parts}
    if len(inner) == 1 and values:
        shape = [len(values)] + list(next(iter(inner)))
        return shape, [x for _, flat in parts for x in flat]
    return [len(values)], list(values)


def nest(flat: list, shape: list[int]) -> Any:
    """The nested lists (one level per dim of ``shape``) of the C-order values ``flat``."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return list(flat)
    step = len(flat) // shape[0] if shape[0] else 0
    return [nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
