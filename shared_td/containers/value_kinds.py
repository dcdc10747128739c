"""What kind of value an entry is, and the checks of a write into one: the predicates
(:func:`is_tensor_collection`, :func:`is_non_tensor`, :func:`default_is_leaf`, ...),
:func:`parse_device`, :func:`check_write_into` and :func:`self_nesting_error`.

They are in a module of their own, below base.py (which re-exports them), so that the
mixins of TensorDictBase (which base.py imports) can import them at the top instead of
inside their functions. A tensordict class is recognized by :class:`TensorDictRoot`,
which TensorDictBase derives from: this module never imports base.py.
"""
from __future__ import annotations

from typing import Any

import torch

from shared_td.containers import batch as batch_ops
from shared_td.errors import BatchSizeMismatchError, InPlaceKindError, InPlaceWriteError
from shared_td.keys import NestedKey, key_repr
from shared_td.tensorclass_protocol import is_tensorclass

__all__ = [
    "TensorDictRoot", "check_write_into", "default_is_leaf", "is_lazy_stack", "is_lazy_stack_class",
    "is_leaf_nontensor", "is_non_tensor", "is_non_tensor_class", "is_tensor_collection", "on_cuda",
    "parse_device", "self_nesting_error",
]


class TensorDictRoot:
    """The root of every tensordict class: TensorDictBase's first base and nothing else's,
    so ``isinstance(value, TensorDictRoot)`` is ``isinstance(value, TensorDictBase)``. No
    ``__slots__`` (its subclasses have a ``__dict__``): a class that seems to have slots
    looks stateless to code that reads an object's state from them."""


def parse_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device (None stays None); a CUDA device without an index is
    the current CUDA device, as tensordict makes it (``TensorDict(..., device="cuda")``
    has the device ``cuda:0``, and its leaves compare equal to it)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def on_cuda(device: torch.device | None) -> bool:
    """Whether ``device`` (None: not one) is a CUDA device."""
    return device is not None and device.type == "cuda"


def is_tensor_collection(value: Any) -> bool:
    """True for tensordicts, tensorclass instances and non-tensor containers, and for
    their classes (as tensordict's: ``keys(is_leaf=...)`` passes classes, so
    ``is_leaf=lambda cls: not is_tensor_collection(cls)`` must see them as collections)."""
    if isinstance(value, type):
        return issubclass(value, TensorDictRoot) or is_tensorclass(value)
    return isinstance(value, TensorDictRoot) or is_tensorclass(value)


def is_non_tensor(value: Any) -> bool:
    """True for NonTensorData and NonTensorStack."""
    return is_non_tensor_class(type(value))


def is_lazy_stack(value: Any) -> bool:
    """True for a LazyStackedTensorDict (a tensorclass around a stack is not one)."""
    return is_lazy_stack_class(type(value))


def is_lazy_stack_class(cls: type) -> bool:
    """True for LazyStackedTensorDict (and its subclasses), told by a class marker of its
    mixin (lazy_writes.LazyWriteOps): lazy.py cannot be imported here (it imports this
    module)."""
    return getattr(cls, "_is_lazy_stack", False)


def is_nested_node(value: Any) -> bool:
    """A nested tensordict, lazy stack or tensorclass: a collection that is not a
    non-tensor entry (NonTensorData and NonTensorStack are collections too)."""
    return is_tensor_collection(value) and not is_non_tensor(value)


def is_non_tensor_class(cls: type) -> bool:
    """True for the classes NonTensorData and NonTensorStack (and their subclasses)."""
    return getattr(cls, "_is_non_tensor", False)


def default_is_leaf(cls: type) -> bool:
    """The default ``is_leaf`` of ``keys``/``values``/``items`` (as tensordict 0.15.3):
    anything but a tensordict, a tensorclass or a non-tensor container, so
    ``leaves_only=True`` lists tensors only.

    Example:
        >>> default_is_leaf(torch.Tensor), default_is_leaf(NonTensorData), default_is_leaf(TensorDict)
        (True, False, False)
    """
    return not (issubclass(cls, TensorDictRoot) or is_tensorclass(cls))


def is_leaf_nontensor(cls: type) -> bool:
    """An ``is_leaf`` that also counts NonTensorData and NonTensorStack as leaves.

    Example:
        >>> td = TensorDict(a=torch.zeros(()), task="walk")
        >>> list(td.keys(leaves_only=True)), list(td.keys(leaves_only=True, is_leaf=is_leaf_nontensor))
        (['a'], ['a', 'task'])
    """
    return default_is_leaf(cls) or getattr(cls, "_is_non_tensor", False)


def check_write_into(current: Any, value: Any, key: str | tuple[str, ...]) -> None:
    """Raise, naming the key, if the converted ``value`` cannot be written in place into
    the entry ``current``; writes nothing (update_ checks every entry before writing)."""
    if isinstance(current, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            raise InPlaceKindError(
                f"Cannot write a {type(value).__name__} in place into tensor entry {_shown(key)}."
            )
        if not batch_ops.broadcasts_to(value.shape, current.shape):
            raise BatchSizeMismatchError(
                f"Cannot write a value of shape {list(value.shape)} in place into entry "
                f"{_shown(key)} of shape {list(current.shape)}."
            )
        if not current.is_contiguous() and _overlaps(current):  # (an expanded tensor is never contiguous)
            raise InPlaceWriteError(
                f"Cannot write entry {_shown(key)} in place: it is expanded (shape {list(current.shape)}, "
                f"strides {list(current.stride())}), so several of its elements are one memory location. "
                "Write into a contiguous copy (td = td.contiguous()), or set() a new value."
            )
    elif is_non_tensor(current):
        try:
            current._check_update(value)
        except (ValueError, TypeError) as error:  # BatchSizeMismatchError too: name the key
            kind = InPlaceKindError if type(error) is TypeError else type(error)  # (a value of another kind)
            raise kind(f"Cannot write into the non-tensor entry {_shown(key)}: {error}") from None
    elif is_tensor_collection(current) and (not is_tensor_collection(value) or is_non_tensor(value)):
        raise InPlaceKindError(
            f"Cannot write a {type(value).__name__} in place into the nested tensordict "
            f"{_shown(key)}: give a dict or tensordict of its entries."
        )


def nested_tensor_error(key: NestedKey, action: str) -> NotImplementedError:
    """The error of ``action`` ("Cannot store the entry") for a nested tensor
    (``torch.nested``) given for ``key``: shared_td stores none (its ``.shape`` is
    torch's "Internal error ... Please file an issue")."""
    return NotImplementedError(
        f"{action} {_shown(key)}: its value is a nested tensor (torch.nested), which shared_td does not "
        "support. Store its components (value.unbind()) as separate entries, or a padded tensor "
        "(torch.nested.to_padded_tensor(value, 0.0)) with their lengths.")


def _overlaps(tensor: torch.Tensor) -> bool:
    """Whether some elements of ``tensor`` are one memory location (a dim of stride 0
    and more than one element: what ``expand()`` makes, and torch refuses to write)."""
    return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))


def _shown(key: str | tuple[str, ...]) -> str:
    """How an error message names ``key`` (made only when there is an error)."""
    return key_repr(key) if isinstance(key, tuple) else repr(key)


def self_nesting_error(key: NestedKey) -> ValueError:
    """The ValueError (as in tensordict) for setting a tensordict inside itself, which
    would make a cycle that every walk of the tree (repr, clone, memmap_) loops on."""
    return ValueError(
        f"Cannot set a tensordict inside itself (key {_shown(key)}): a tensordict cannot "
        "contain itself. Set a copy (td.clone()) or another tensordict instead."
    )
