"""``td["names"]`` of a NonTensorStack: a list whose item assignments write into the stack.

tensordict 0.15.3 gives a ``LinkedList`` there (and for a tensorclass field holding a
stack): ``values = td["names"]; values[0] = "z"`` writes ``"z"`` into the tensordict,
where a plain list (what shared_td gave) lost the write in silence. :class:`LinkedList`
does the same here: an item or slice assignment is written into the stack first, as
``stack[i] = value`` writes it (into its files or shared memory too, through a lazy
stack into its members), and reaches the list only once that write succeeded; a nested
stack gives nested LinkedLists, each writing at its own position. The methods that
change the length of the list (``append``, ``extend``, ``insert``, ``pop``, ``remove``,
``clear``, ``del``, ``+=``, ``*=``) change the list only and unlink it: later
assignments no longer write back, as in tensordict. It compares equal to a list of the
same items; ``tolist()`` is a plain copy; a pickle or a copy of it is not linked (it
never carries the tensordict with it). torch's pytree walks it as a list, as tensordict
registers its own (``tree_leaves(td["names"])`` gives the values; rebuilt, a plain list).

Example:
    >>> from shared_td import TensorDict
    >>> td = TensorDict(batch_size=[3])
    >>> td["names"] = ["a", "b", "c"]
    >>> values = td["names"]
    >>> values[0] = "z"
    >>> td.get("names").tolist(), values.tolist()
    (['z', 'b', 'c'], ['z', 'b', 'c'])
"""
from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

__all__ = ["LinkedList", "linked_values"]


class LinkedList(list):
    """A list of the values of a NonTensorStack that writes item assignments back into
    it (see the module doc). ``LinkedList(iterable)`` alone is linked to nothing."""

    def __init__(self, *args: Any, stack: Any = None, at: tuple = ()) -> None:
        super().__init__(*args)
        self._stack, self._at = stack, at

    def __setitem__(self, index: Any, value: Any) -> None:
        if self._stack is not None:  # (first: a write the stack refuses leaves the list as it is)
            self._stack[self._at + (index,)] = value
        super().__setitem__(index, value)

    def __repr__(self) -> str:
        return f"LinkedList({list.__repr__(self)})"  # (as tensordict's; str() too, nested ones inside)

    def tolist(self) -> list:
        """A plain copy, nested lists for a nested stack, linked to nothing."""
        return [item.tolist() if isinstance(item, LinkedList) else item for item in self]

    def __reduce_ex__(self, protocol: int) -> tuple:
        return LinkedList, (self.tolist(),)  # (never the stack and its tensordict)

    def __copy__(self) -> "LinkedList":
        return LinkedList(self)

    def _unlinked(name: str):  # noqa: N805 - builds the methods below
        method = getattr(list, name)

        def changes_the_length(self: "LinkedList", *args: Any, **kwargs: Any) -> Any:
            self._stack = None  # (the positions no longer match the stack's)
            return method(self, *args, **kwargs)

        changes_the_length.__name__ = name
        return changes_the_length

    append = _unlinked("append")
    extend = _unlinked("extend")
    insert = _unlinked("insert")
    pop = _unlinked("pop")
    remove = _unlinked("remove")
    clear = _unlinked("clear")
    __delitem__ = _unlinked("__delitem__")
    __iadd__ = _unlinked("__iadd__")
    __imul__ = _unlinked("__imul__")
    del _unlinked


def linked_values(stack: Any) -> LinkedList:
    """``stack.tolist()`` (a NonTensorStack's values, one level per batch dim) as nested
    LinkedLists that write into ``stack``."""
    return _linked(stack, stack.tolist(), (), len(stack.batch_size))


def _linked(stack: Any, values: list, at: tuple, depth: int) -> LinkedList:
    if depth > 1:
        values = [_linked(stack, item, at + (i,), depth - 1) for i, item in enumerate(values)]
    return LinkedList(values, stack=stack, at=at)


def _flatten_with_keys(values: LinkedList) -> tuple[list, None]:
    return [(pytree.SequenceKey(i), item) for i, item in enumerate(values)], None


# (the public torch.utils.pytree of newer torch registers through this one too)
pytree.register_pytree_node(LinkedList, lambda values: (list(values), None), lambda items, _: list(items),
                            serialized_type_name="shared_td.LinkedList", flatten_with_keys_fn=_flatten_with_keys)
