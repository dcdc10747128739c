"""The ``__init__`` of a tensorclass: the one ``@tensorclass`` generates from the fields,
and the wrapper around a class's own ``__init__`` (tensordict 0.15.3's behaviour).

Both take ``batch_size``, ``device``, ``names`` and ``lock`` by keyword. A class's own
``__init__`` runs with the container already built from them (``self.batch_size`` is
the given one), unless it names one of them as its own parameter, which then reaches
it. A generated ``__init__`` called from inside a class's own one (``super().__init__``)
keeps the container, with the fields set before it, and the batch size, device and
names the outer call was given unless it gives its own.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch

from shared_td.containers.base import is_tensor_collection
from shared_td.containers.nontensor import NonTensorData
from shared_td.containers.tensordict import TensorDict
from shared_td.containers.tensorclass_members import MEMBERS, _no_field_message, _store
from shared_td.errors import ArgumentGivenTwiceError, BatchSizeMismatchError

__all__ = ["ArgumentGivenTwiceError", "in_init", "make_init", "note_assigned", "wrap_user_init"]

_MISSING = dataclasses.MISSING
#: the keywords of every tensorclass's __init__, beside the fields
_CONTAINER_KEYWORDS = ("batch_size", "device", "names", "lock")


class _Factory:
    def __repr__(self) -> str:
        return "<factory>"


_FACTORY = _Factory()  # the default shown in __init__'s signature for default_factory fields


def _store_default(obj: Any, name: str, value: Any) -> None:
    """Defaults that do not fit the batch as tensors (``n: int = 3`` with a batch size)
    are kept as Python values, as tensordict does."""
    try:
        _store(obj, name, value)
    except BatchSizeMismatchError:
        if isinstance(value, torch.Tensor) or is_tensor_collection(value):
            raise
        td = obj._tensordict
        td.set(name, NonTensorData(value, batch_size=td.batch_size, device=td.device))


def _container_parameters() -> list:
    kind = inspect.Parameter
    # (lock=: accepted, unlisted, as in tensordict)
    return [kind(name, kind.KEYWORD_ONLY, default=None) for name in ("batch_size", "device", "names")]


def make_init(cls: type, fields: tuple) -> Any:
    # a field named batch_size, device or names (shadow=True) takes that keyword
    keywords = [name for name in _CONTAINER_KEYWORDS if name not in {f.name for f in fields}]

    def __init__(self, *args, **kwargs):
        given = {name: kwargs.pop(name) for name in keywords if name in kwargs}
        _init_fields(self, fields, args, kwargs, given.get("batch_size"), given.get("device"),
                     given.get("names"), given.get("lock", False))

    kind = inspect.Parameter
    params = [kind("self", kind.POSITIONAL_OR_KEYWORD)]
    for f in fields:
        default = f.default if f.default is not _MISSING else (
            kind.empty if f.default_factory is _MISSING else _FACTORY
        )
        params.append(kind(f.name, kind.KEYWORD_ONLY if f.kw_only else kind.POSITIONAL_OR_KEYWORD,
                           default=default, annotation=f.type))
    params += [p for p in _container_parameters() if p.name in keywords]
    params.sort(key=lambda p: p.kind)  # keyword-only after positional
    try:
        __init__.__signature__ = inspect.Signature(params)
    except ValueError:  # a required field after a defaulted one: no clean signature
        pass
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__doc__ = f"Build a {cls.__name__} from its fields, batch_size, device and names."
    return __init__


def wrap_user_init(user_init: Any, field_names: frozenset) -> Any:
    """A class's own ``__init__`` runs on a container built from ``batch_size`` and
    ``device``; ``names`` and ``lock`` (and a frozen class's lock) are applied once it
    returns, and the fields it left unset get their defaults (a required one is a
    TypeError). A keyword that ``user_init`` names itself reaches it as well, unless a
    field has that name (``shadow=True``): then it is only the field."""
    if getattr(user_init, "_tc_wrapped", False):
        return user_init
    signature = inspect.signature(user_init)
    own = set(signature.parameters) & set(_CONTAINER_KEYWORDS)
    keywords = [name for name in _CONTAINER_KEYWORDS if name not in field_names]

    @functools.wraps(user_init)
    def __init__(self, *args, **kwargs):
        given = {name: kwargs[name] for name in keywords if name in kwargs}
        for name in given.keys() - own:
            del kwargs[name]
        outermost = "_tensordict" not in self.__dict__
        if outermost:
            td = TensorDict(batch_size=given.get("batch_size"), device=given.get("device"))
            object.__setattr__(self, "_tensordict", td)
            self.__dict__.update(_tc_init_container=td, _tc_init_set=set())
        try:
            user_init(self, *args, **kwargs)
        except BaseException:
            if outermost:
                _end_init(self)
            raise
        if given.get("names") is not None:
            self._tensordict.names = given["names"]
        if given.get("lock"):
            self.__dict__["_tc_init_lock"] = True
        if outermost:
            assigned, lock = _end_init(self)
            _fill_unset_fields(self, assigned)
            if lock or type(self)._frozen:
                self._tensordict.lock_()

    __init__._tc_wrapped = True
    params = list(signature.parameters.values())  # (self first: inspect drops it for the class)
    var_keyword = [p for p in params if p.kind is p.VAR_KEYWORD]
    params = [p for p in params if p.kind is not p.VAR_KEYWORD]
    params += [p for p in _container_parameters() if p.name not in own and p.name in keywords] + var_keyword
    try:
        __init__.__signature__ = inspect.Signature(params)
    except ValueError:  # (an odd signature: inspect then shows the user's)
        pass
    return __init__


def in_init(obj: Any) -> bool:
    """True while a class's own ``__init__`` runs on ``obj`` (a frozen class's fields
    can be set then, as with ``object.__setattr__`` in a frozen dataclass)."""
    return "_tc_init_container" in obj.__dict__


def note_assigned(obj: Any, name: str) -> None:
    """Record that a field was set during a class's own ``__init__`` (None included)."""
    assigned = obj.__dict__.get("_tc_init_set")
    if assigned is not None:
        assigned.add(name)


def _end_init(obj: Any) -> tuple:
    state = obj.__dict__
    state.pop("_tc_init_container", None)
    return state.pop("_tc_init_set", set()), state.pop("_tc_init_lock", False)


def _fill_unset_fields(obj: Any, assigned: set) -> None:
    cls = type(obj)
    present = set(obj._tensordict.keys())
    for f in cls._tc_fields:
        if f.name in present or f.name in assigned:
            continue
        if f.default is not _MISSING or f.default_factory is not _MISSING:
            _store_default(obj, f.name, f.default if f.default_factory is _MISSING else f.default_factory())
        elif f.init:
            raise TypeError(
                f"{cls.__name__}.__init__() did not set the required field {f.name!r}: set it "
                f"there (self.{f.name} = ...) or give the field a default."
            )


def _init_fields(self, fields, args, kwargs, batch_size, device, names, lock) -> None:
    # ``fields``: those of the class whose generated __init__ runs (a base's, when a
    # subclass's own __init__ calls super().__init__(): it sets the rest itself)
    cls = type(self)
    field_names = {f.name for f in fields}
    outer = self.__dict__.get("_tc_init_container")  # called by a class's own __init__
    positional = [f for f in fields if not f.kw_only]
    if len(args) > len(positional):
        n = len(positional) + 1
        raise TypeError(
            f"{cls.__name__}.__init__() takes {n} positional argument{'s' if n > 1 else ''} "
            f"but {len(args) + 1} were given; pass batch_size, device and names by keyword"
        )
    values = {f.name: value for f, value in zip(positional, args)}
    for name, value in kwargs.items():
        if name in values:
            raise ArgumentGivenTwiceError(
                f"{cls.__name__}.__init__() got multiple values for argument {name!r}: the key "
                f"{name} is already set by a positional argument; give it once."
            )
        values[name] = value
    already = set(outer.keys()) if outer is not None else set()
    missing = [f.name for f in fields if f.name not in values and f.name not in already
               and f.default is _MISSING and f.default_factory is _MISSING]
    unknown = [name for name in kwargs if name not in field_names]
    if missing:
        message = (f"{cls.__name__}.__init__() missing {len(missing)} required positional "
                   f"argument{'s' if len(missing) > 1 else ''}: {', '.join(map(repr, missing))}")
        if unknown:
            message += f"; it also got unexpected keyword arguments {unknown}"
        raise TypeError(f"{message}. Its fields are {sorted(field_names)}.")
    if unknown:
        raise AttributeError(_no_field_message(cls, unknown[0]))
    if outer is not None:  # keep what the outer call was given, and the fields set already
        batch_size = outer.batch_size if batch_size is None else batch_size
        device = outer.device if device is None else device
        names = outer.names if names is None else names
    td = TensorDict(batch_size=batch_size, device=device)
    object.__setattr__(self, "_tensordict", td)
    for key, value in (outer.items() if outer is not None else ()):
        td.set(key, value)
    # a __setattr__ of the class (or a base) sees each field, as with tensordict
    assign = setattr if type(self).__setattr__ is not MEMBERS["__setattr__"] and not cls._frozen else _store
    for f in fields:
        if f.name in values:
            assign(self, f.name, values[f.name])
            note_assigned(self, f.name)
        elif f.name in already:
            continue
        elif f.default is not _MISSING or f.default_factory is not _MISSING:
            default = f.default if f.default_factory is _MISSING else f.default_factory()
            _store_default(self, f.name, default)
    if outer is not None:  # the class's own __init__ goes on: it may set them after this
        self.__dict__["_tc_init_container"] = td
    if names is not None:
        td.names = names
    if hasattr(cls, "__post_init__"):
        self.__post_init__()
    if outer is not None:  # the class's own __init__ locks once it returns
        self.__dict__["_tc_init_lock"] = self.__dict__.get("_tc_init_lock", False) or lock
    elif lock or cls._frozen:
        td.lock_()
