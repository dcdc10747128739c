"""tensordict 0.15.3's two global options of non-tensor data, for code that sets them
(torchrl, for one, calls ``set_list_to_stack(True).set()`` at import):

* :class:`set_list_to_stack` / :func:`list_to_stack` -- whether a list written into a
  tensordict is one value per element (a NonTensorStack, the default) or, with
  ``False``, one value (a NonTensorData) unless it is numbers (then a tensor, as always);
* :class:`set_capture_non_tensor_stack` / :func:`capture_non_tensor_stack` -- whether
  ``torch.stack`` of NonTensorData of one equal value gives that one value (a
  NonTensorData, with ``True``) rather than a NonTensorStack (the default).

As in tensordict 0.15.3: each is a context manager, a decorator, or ``.set()`` for the
rest of the program; the mode is one for the whole process (all threads), read from the
``LIST_TO_STACK`` / ``CAPTURE_NONTENSOR_STACK`` environment variables at import and
written into them while set (so child processes share it); the
non-default modes are deprecated there (removed in tensordict 0.17) and warn so here.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any, Callable

__all__ = ["capture_non_tensor_stack", "list_to_stack", "set_capture_non_tensor_stack", "set_list_to_stack"]

_FALSE = ("0", "n", "no", "f", "false", "off")
_TRUE = ("1", "y", "yes", "t", "true", "on")


def _from_environment(name: str) -> bool | None:
    text = os.environ.get(name, "").strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return None  # unset, empty or "none": never set (the default applies), as in tensordict


# option name -> its current mode, None while never set (one per process, as
# tensordict's module globals)
_MODES = {"LIST_TO_STACK": _from_environment("LIST_TO_STACK"),
          "CAPTURE_NONTENSOR_STACK": _from_environment("CAPTURE_NONTENSOR_STACK")}


def _mode(option: str, default: bool, allow_none: bool) -> bool | None:
    mode = _MODES[option]
    if mode is None and not allow_none:
        return default
    return mode


class _GlobalMode:
    """A process-wide option: ``with option(mode):``, ``@option(mode)`` on a function
    (each call runs in the mode; each step of a generator function), or
    ``option(mode).set()``. Processes started meanwhile inherit it (the environment
    variable is set with it)."""

    _option = ""  # the key in _MODES, also the environment variable read at import
    _default = True
    _deprecation = ""  # what the warning of the non-default mode says to use instead

    def __init__(self, mode: bool) -> None:
        self.mode = bool(mode)
        self._before: list[bool | None] = []  # (a stack: the same object may be entered twice)
        if self.mode != self._default:
            warnings.warn(f"{type(self).__name__}({self.mode}) is deprecated in tensordict 0.15.3 and removed "
                          f"in 0.17: {self._deprecation}", DeprecationWarning, stacklevel=2)

    def set(self) -> None:
        """Apply the mode for the rest of the program, and to the processes it starts
        then (the environment variable is set too, as tensordict 0.15.3 does)."""
        _MODES[self._option] = self.mode
        os.environ[self._option] = str(self.mode)

    def __enter__(self) -> None:
        self._before.append((_MODES[self._option], os.environ.get(self._option)))
        _MODES[self._option] = self.mode
        os.environ[self._option] = str(self.mode)

    def __exit__(self, *exc_info: Any) -> None:
        mode, environment = self._before.pop()
        _MODES[self._option] = mode
        if environment is None:
            os.environ.pop(self._option, None)
        else:
            os.environ[self._option] = environment

    def __call__(self, function: Callable) -> Callable:
        if inspect.isgeneratorfunction(function):
            return self._steps_in_mode(function)

        @functools.wraps(function)
        def in_mode(*args: Any, **kwargs: Any) -> Any:
            with self:
                return function(*args, **kwargs)

        return in_mode

    def _steps_in_mode(self, function: Callable) -> Callable:
        """A generator function whose every step (``next``, ``send``, ``throw``, ``close``)
        runs in the mode, and outside it between steps, as torch's decorators do."""
        @functools.wraps(function)
        def steps_in_mode(*args: Any, **kwargs: Any) -> Any:
            with self:
                generator = function(*args, **kwargs)
            step = functools.partial(generator.send, None)
            while True:
                try:
                    with self:
                        value = step()
                except StopIteration as stop:
                    return stop.value
                try:
                    reply = yield value
                except GeneratorExit:
                    with self:
                        generator.close()
                    raise
                except BaseException as error:  # thrown in: into the generator, in the mode
                    step = functools.partial(generator.throw, error)
                else:
                    step = functools.partial(generator.send, reply)

        return steps_in_mode


class set_list_to_stack(_GlobalMode):
    """Whether a list written into a tensordict (``td["x"] = ["a", "b"]``, the
    constructor, ``set``) is one value per element of the first batch dimension (a
    NonTensorStack: ``True``, the default) or one value (a NonTensorData: ``False``,
    deprecated in tensordict 0.15.3). A list of numbers is a tensor either way.

    Example:
        >>> from shared_td import TensorDict, list_to_stack
        >>> with set_list_to_stack(True):
        ...     td = TensorDict({"x": ["a", "b"]}, batch_size=[2])
        >>> type(td.get("x")).__name__, list_to_stack()
        ('NonTensorStack', True)
    """

    _option, _default = "LIST_TO_STACK", True
    _deprecation = "use td.set_non_tensor(key, value) to store a list as one value."


class set_capture_non_tensor_stack(_GlobalMode):
    """Whether ``torch.stack`` of NonTensorData that hold one equal value gives that
    value as one NonTensorData (``True``, deprecated in tensordict 0.15.3) or a
    NonTensorStack (``False``, the default).

    Example:
        >>> import torch
        >>> from shared_td import NonTensorData
        >>> with set_capture_non_tensor_stack(False):
        ...     stack = torch.stack([NonTensorData("a"), NonTensorData("a")])
        >>> type(stack).__name__, stack.tolist()
        ('NonTensorStack', ['a', 'a'])
    """

    _option, _default = "CAPTURE_NONTENSOR_STACK", False
    _deprecation = "read the values of the stack (tolist())."


def list_to_stack(allow_none: bool = False) -> bool | None:
    """Whether a list written into a tensordict is a NonTensorStack (see
    :class:`set_list_to_stack`); ``allow_none``: None while the mode was never set.

    Example:
        >>> list_to_stack()
        True
    """
    return _mode("LIST_TO_STACK", set_list_to_stack._default, allow_none)


def capture_non_tensor_stack(allow_none: bool = False) -> bool | None:
    """Whether ``torch.stack`` of equal NonTensorData gives one NonTensorData (see
    :class:`set_capture_non_tensor_stack`); ``allow_none``: None while never set.

    Example:
        >>> capture_non_tensor_stack()
        False
    """
    return _mode("CAPTURE_NONTENSOR_STACK", set_capture_non_tensor_stack._default, allow_none)
