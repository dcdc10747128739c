"""The members every tensorclass gets: the tensordict API forwarded to ``_tensordict``.

Results that are the inner tensordict give back the instance; other tensordicts whose
keys are all fields are rewrapped into the class (``x[0]``, ``x.clone()``, ``x == y``,
``x.unbind(0)``...). ``shared_td.containers.tensorclass`` adds ``MEMBERS`` to each
decorated class, skipping the names the class already defines.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from shared_td.containers.base import NO_DEFAULT, TensorDictBase, is_non_tensor, is_tensor_collection
from shared_td.containers.lazy_writes import _is_branch, _peek
from shared_td.containers.memmap_methods import MemmapMethods
from shared_td.containers.nontensor import NonTensorData, as_non_tensor
from shared_td.containers.tensorclass_compat import check_row_write
from shared_td.containers.tensordict import TensorDict
from shared_td.keys import RAISE, is_nested_key, unravel_key
from shared_td.tensorclass_protocol import is_tensorclass, unwrap_tensorclass


def _store(obj: Any, name: str, value: Any) -> None:
    """Set field ``name``: None removes the entry; dicts (and with ``nocast`` every
    non-tensor) are kept as NonTensorData (with ``nocast``, a list as a NonTensorStack
    of one value per element, as tensordict 0.15.3), the rest is converted as
    TensorDict.set does.

    As tensordict 0.15.3: a number given to a field annotated ``int``, ``float`` or
    ``bool`` (or Optional of them) of a batched instance stays a Python number, since a
    0-d tensor would not fit the batch size.
    """
    td = obj._tensordict
    if value is None:
        if td._get_str(name, None) is not None:
            td.del_(name)
        return
    plain = not isinstance(value, torch.Tensor) and not is_tensor_collection(value)
    if isinstance(value, dict) or (plain and type(obj)._nocast):  # (a list: one value per element)
        value = as_non_tensor(value, td.batch_size, name, td.device)
    value = _kept_number(obj, name, value)
    td.set(name, value)


def _kept_number(obj: Any, name: str, value: Any) -> Any:
    """``value`` as a NonTensorData if it is a number given to an ``int``/``float``/
    ``bool`` field of a batched instance (see ``_store``), else unchanged."""
    scalar_types = type(obj)._tc_scalar_fields.get(name)
    td = obj._tensordict
    if scalar_types and td.batch_dims and isinstance(value, scalar_types):
        return NonTensorData(value, batch_size=td.batch_size, device=td.device)
    return value


def _no_field_message(cls: type, name: str) -> str:
    return (f"Cannot set the attribute {name!r}: {cls.__name__} has no such field. "
            f"Its fields are {sorted(cls._tc_field_names)}.")


# ------------------------------------------------------------------------ wrapping
def _wrap(obj: Any, result: Any) -> Any:
    """The instance for its own tensordict; the class around tensordicts of its fields."""
    if result is obj._tensordict:
        return obj
    if isinstance(result, TensorDictBase) and not is_non_tensor(result):
        if set(result._keys_str()) <= type(obj)._tc_field_names:
            return type(obj)._from_tensordict(result)
        op = getattr(result, "_last_op", None)
        if isinstance(op, tuple) and op[0] == "write_back":
            # (tc.flatten_keys() of a nested field, a TensorDict: leaving its block must not
            # put a key that is no field into the instance, which set() and update() refuse)
            result._last_op = ("write_back", _fields_checked(type(obj), *op[1:]), op[2])
        return result
    if isinstance(result, tuple) and result and all(isinstance(r, TensorDictBase) for r in result):
        return tuple(_wrap(obj, r) for r in result)
    return result


def _fields_checked(cls: type, write_back: Callable, restore: Callable) -> Callable:
    """``write_back`` (of a ``with`` block's result), once the keys it would write are
    checked to be fields of the tensorclass ``cls``: a ValueError, nothing written,
    otherwise. (The class, not the instance: the result holds its source weakly.)"""
    def checked(out: Any) -> None:
        extra = sorted(set(restore(out)._keys_str()) - cls._tc_field_names)
        if extra:
            raise ValueError(f"Keys {extra} are not fields of {cls.__name__} (its fields are "
                             f"{sorted(cls._tc_field_names)}); nothing was written back.")
        write_back(out)
    return checked


# The options of update()/update_() that a tensorclass passes on (any other keyword is a field)
_UPDATE_OPTIONS = frozenset({"clone", "non_blocking", "keys_to_update", "is_leaf", "update_batch_size",
                             "ignore_lock"})


def _field_keywords(obj: Any, kwargs: dict) -> dict:
    """Take out of ``kwargs`` the keywords that name fields of ``obj``: entries of an
    update (``tc.update(a=...)``, as in tensordict); the rest are options. A keyword that
    is neither is a ValueError naming it, before anything is written (as tensordict's)."""
    fields = type(obj)._tc_field_names
    unknown = sorted(name for name in kwargs if name not in fields and name not in _UPDATE_OPTIONS)
    if unknown:
        raise ValueError(f"Keys {unknown} are not fields of {type(obj).__name__} (its fields are "
                         f"{sorted(fields)}); nothing was updated.")
    return {name: kwargs.pop(name) for name in list(kwargs) if name in fields}


def _forward(name: str, wrap: bool) -> Any:
    def method(self, *args, **kwargs):
        result = getattr(self._tensordict, name)(*map(unwrap_tensorclass, args), **kwargs)
        return _wrap(self, result) if wrap else result

    method.__name__ = method.__qualname__ = name
    method.__doc__ = getattr(getattr(TensorDict, name, None), "__doc__", None)
    return method


def _td_property(name: str, settable: bool = False) -> property:
    def fget(self):
        return getattr(self._tensordict, name)

    def fset(self, value):
        setattr(self._tensordict, name, value)

    return property(fget, fset if settable else None, doc=getattr(TensorDict, name).__doc__)


def _refuse_device_assignment(self, value: Any) -> None:
    # tensordict raises this RuntimeError (its message too): a tensorclass moves with to()
    raise RuntimeError(
        f"device cannot be set using tensorclass.device = device ({type(self).__name__}"
        f".device = {value!r}): the leaves would stay where they are. Use "
        "tensorclass.to(new_device), which returns a new tensorclass on that device."
    )


_WRAPPED = (
    "unbind split chunk to cpu cuda pin_memory pin_memory_ clone contiguous expand reshape view "
    "unsqueeze squeeze permute transpose swapaxes swapdims movedim moveaxis flatten unflatten "
    "apply named_apply set_ lock_ unlock_ "
    "share_memory_ exclude empty zero_ fill_ copy_ del_ refine_names auto_batch_size_ "
    "__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __enter__ __exit__ all any "  # (all(dim) is a tensordict)
    "repeat repeat_interleave clear_device_ auto_device_ filter_empty_"
).split()
_PLAIN = (
    "keys values items numel dim size is_shared is_memmap is_empty pop "
    "get_non_tensor is_non_tensor __len__ __bool__ __contains__"
).split()


class _TensorClassMembers:
    """The members added to every tensorclass (collected into ``MEMBERS``)."""

    _is_tensorclass = True

    def del_(self, key: Any) -> Any:
        """Remove the entry ``key``; returns self. A field set to None holds no entry:
        deleting it leaves it None, as tensordict 0.15.3 does (no KeyError)."""
        path = unravel_key(key)
        if len(path) == 1 and path[0] in type(self)._tc_field_names and path[0] not in self._tensordict.keys():
            return self
        self._tensordict.del_(key)
        return self

    def rename_key_(self, old_key: Any, new_key: Any, safe: bool = False) -> Any:
        """Move the entry ``old_key`` to ``new_key``; returns self. A ``new_key`` that is no
        field is an AttributeError before anything changes, as ``set`` raises (tensordict
        0.15.3 renames, then cannot load its save or rebuild the instance)."""
        new = unravel_key(new_key)
        if new[0] not in type(self)._tc_field_names:
            raise AttributeError(_no_field_message(type(self), new[0]))
        self._tensordict.rename_key_(old_key, new_key, safe=safe)
        return self

    batch_size = _td_property("batch_size", settable=True)
    names = _td_property("names", settable=True)
    is_locked = _td_property("is_locked", settable=True)
    shape = _td_property("shape")
    batch_dims = _td_property("batch_dims")
    ndim = _td_property("ndim")
    device = property(_td_property("device").fget, _refuse_device_assignment,
                      doc=TensorDict.device.__doc__)

    __torch_function__ = TensorDictBase.__dict__["__torch_function__"]

    @classmethod
    def _from_tensordict(cls, tensordict: TensorDictBase, *, _rebuild: bool = True,
                         _stored: bool = False, _lock: bool = True) -> Any:
        """An instance around ``tensordict`` (shared, not copied), without checks.
        ``_stored``: the instance a container holds given back (a lazy stack's member,
        where tensordict 0.15.3 returns the stored object): no ``__post_init__`` and no
        lock, which a read must not run. ``_lock=False``: a frozen class does not lock
        ``tensordict`` (a lazy stack's members, which it shares)."""
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_tensordict", tensordict)
        if _stored:
            return obj
        if hasattr(cls, "__post_init__") and not (_rebuild and cls._skip_post_init_on_rebuild):
            obj.__post_init__()
        if _lock and cls._frozen and not tensordict.is_locked:
            tensordict.lock_()
        return obj

    @classmethod
    def from_tensordict(cls, tensordict: TensorDictBase, non_tensordict: dict | None = None, safe: bool = True) -> Any:
        """An instance whose fields are the entries of ``tensordict`` (shared, not copied);
        fields it lacks are None. ``non_tensordict`` sets more fields. ``safe`` is
        accepted for compatibility with tensordict, and ignored: keys that are not fields
        are always refused.

        Raises:
            ValueError: if ``tensordict`` has keys that are not fields of the class.
        """
        if not isinstance(tensordict, TensorDictBase):
            raise TypeError(f"{cls.__name__}.from_tensordict() needs a TensorDict, got {type(tensordict).__name__}.")
        extra = set(tensordict._keys_str()) - cls._tc_field_names
        if extra:
            raise ValueError(
                f"Keys {sorted(extra)} of the tensordict are not fields of {cls.__name__} "
                f"(its fields are {sorted(cls._tc_field_names)}): exclude or rename them first."
            )
        obj = cls._from_tensordict(tensordict, _rebuild=False)
        for name, value in (non_tensordict or {}).items():
            if name not in cls._tc_field_names:
                raise ValueError(_no_field_message(cls, name))
            _store(obj, name, value)
        return obj

    @classmethod
    def from_dict(cls, input_dict: Any, *, auto_batch_size: bool | None = None, batch_size: Any = None,
                  device: Any = None, batch_dims: int | None = None) -> Any:
        """Build an instance from a dict of its fields, as tensordict 0.15.3's
        ``TensorClass.from_dict``.

        Fields that ``input_dict`` lacks (or gives as None) are None, also those that
        declare a default: a FutureWarning says so for those, as in tensordict (its
        0.17 fills the defaults, as the constructor does). Nested dicts become
        TensorDicts.

        Args:
            input_dict: the values of the fields (a dict, or a tensordict).
            auto_batch_size: the batch size is the longest leading shape that all the
                entries share. None means False, unless ``batch_dims`` is given.
            batch_size: the batch size of the result (default ``[]``).
            device: the device of the result.
            batch_dims: with ``auto_batch_size``, the most batch dims to keep.

        Raises:
            ValueError: with both ``batch_size`` and ``batch_dims``, or a key that is
                not a field of the class.
        """
        import warnings

        if batch_dims is not None and batch_size is not None:
            raise ValueError(f"{cls.__name__}.from_dict(): pass batch_size or batch_dims, not both.")
        if auto_batch_size is None:
            auto_batch_size = batch_dims is not None  # batch_dims implies it, as in tensordict
        if isinstance(input_dict, TensorDictBase):
            input_dict = input_dict.to_dict()
        # a None value is a missing field (no NonTensorData(None) entry), as in tensordict
        entries = {k: v for k, v in dict(input_dict).items() if v is not None or k not in cls._tc_field_names}
        for key in entries:
            if key not in cls._tc_field_names:
                raise ValueError(_no_field_message(cls, key))
        defaulted = [f.name for f in cls._tc_fields if f.name not in entries and f.init and (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)]
        if defaulted:
            warnings.warn(
                f"{cls.__name__}.from_dict(): the fields {defaulted} are missing and set to None, "
                "not to their defaults (as tensordict 0.15.3; its 0.17 uses the defaults). "
                "Pass them, or call the constructor to get the defaults.",
                FutureWarning, stacklevel=2)
        td = TensorDict.from_dict(entries, batch_size=batch_size, device=device,
                                  auto_batch_size=bool(auto_batch_size))
        if batch_dims is not None and td.batch_dims > batch_dims:
            td.batch_size = td.batch_size[:batch_dims]
        return cls.from_tensordict(td)

    @classmethod
    def from_consolidated(cls, filename: Any) -> Any:
        """The tree of a file written by ``consolidate(filename=...)``, as
        ``TensorDict.from_consolidated``: an instance of the class the file names (this
        tensorclass for a file written from one of its instances)."""
        return TensorDictBase.from_consolidated(filename)

    # see TensorClass._tc_wraps_plain_loads
    _tc_wraps_plain_loads = False

    @classmethod
    def load_memmap(cls, prefix: Any, device: Any = None, non_blocking: bool = False, *, out: Any = None,
                    robust_key: bool | None = True, subpath: Any = None, mode: str | None = None,
                    num_threads: int = 0, allow_pickle: bool | None = None) -> Any:
        """``TensorDict.load_memmap`` (the class is the one saved), with tensordict 0.15.3's
        two rules for a tensorclass: a class saved from ``__main__`` (a script, a
        notebook) under this class's qualname loads as this class, and a ``TensorClass``
        subclass wraps the save of a plain tensordict or lazy stack in itself
        (``from_tensordict``: a key that is no field is a ValueError). ``out=`` takes a
        TensorDict, as ``TensorDict.load_memmap``'s, or an instance of a tensorclass, as in
        tensordict 0.15.3: loaded in place (its fields become those saved) and returned."""
        from shared_td.containers.tensorclass import loading_as

        with loading_as(cls):
            loaded = MemmapMethods.load_memmap.__func__(
                cls, prefix, device, non_blocking, out=out, robust_key=robust_key,  # (its fields checked there)
                subpath=subpath, mode=mode, num_threads=num_threads, allow_pickle=allow_pickle)
        if is_tensorclass(out):
            return out  # (its tensordict was loaded in place)
        if (cls._tc_wraps_plain_loads and out is None and not is_tensorclass(loaded)
                and isinstance(loaded, TensorDictBase) and not is_non_tensor(loaded)):
            return cls.from_tensordict(loaded)
        return loaded

    def load_memmap_(self, prefix: Any, robust_key: bool | None = True, *,
                     allow_pickle: bool | None = None, mode: str | None = None) -> Any:
        """``TensorDict.load_memmap_`` into this instance (tensordict 0.15.3's signature:
        the files are mapped in this thread, there is no ``num_threads``): a class saved
        from ``__main__`` under this class's qualname is this class (see
        ``load_memmap``); the save of another tensorclass is a ValueError, as in
        tensordict 0.15.3, and self is then unchanged."""
        from shared_td.containers.tensorclass import loading_as

        with loading_as(type(self)):
            return MemmapMethods.load_memmap_(self, prefix, robust_key, allow_pickle=allow_pickle, mode=mode)

    def load_(self, prefix: Any, *args: Any, **kwargs: Any) -> Any:
        """Same as ``load_memmap_``."""
        return self.load_memmap_(prefix, *args, **kwargs)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                   flatten: bool = True) -> Any:
        """``TensorDict.state_dict``, this level marked with the class's name and its
        non-tensor fields (None ones included) in ``_metadata``, as tensordict 0.15.3."""
        from shared_td.containers.state_dicts import state_dict_of

        return state_dict_of(self, destination, prefix, keep_vars, flatten)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False,
                        from_flatten: bool | None = None) -> Any:
        """``TensorDict.load_state_dict`` into this instance, its non-tensor fields too."""
        from shared_td.containers.state_dicts import load_state_dict

        return load_state_dict(self, state_dict, strict, assign, from_flatten)

    @classmethod
    def from_remote_init(cls, src: int, group: Any = None, device: Any = None, use_broadcast: bool = False) -> Any:
        """``TensorDict.from_remote_init`` as an instance of this class (a tensorclass that
        arrives is kept as it is; a plain tensordict becomes this class's fields)."""
        arrived = TensorDict.from_remote_init(src, group, device, use_broadcast)
        return arrived if is_tensorclass(arrived) else cls.from_tensordict(arrived)

    @classmethod
    def __init_subclass__(cls, **kwargs: Any) -> None:
        from shared_td.containers.tensorclass import _register

        object.__init_subclass__(**kwargs)
        _register(cls)  # plain subclasses are tensorclasses too

    # ------------------------------------------------------------ attributes
    def __getattr__(self, name: str) -> Any:
        td = self.__dict__.get("_tensordict")
        if td is not None and not name.startswith("_") and hasattr(type(td), name):
            member = getattr(td, name)
            if callable(member):
                return _forward(name, wrap=True).__get__(self)
            return _wrap(self, member)
        fields = sorted(getattr(type(self), "_tc_field_names", ()))
        raise AttributeError(
            f"{type(self).__name__!r} object has no attribute or field {name!r}. "
            f"Its fields are {fields}."
        )

    def __setattr__(self, name: str, value: Any) -> None:
        for klass in type(self).__mro__:
            if name in vars(klass):
                if hasattr(vars(klass)[name], "__set__"):  # a field, a property...
                    object.__setattr__(self, name, value)
                    return
                break
        raise AttributeError(_no_field_message(type(self), name))

    def __getstate__(self) -> dict:
        return {"_tensordict": self._tensordict}

    def __copy__(self) -> Any:
        """``copy.copy``: a new instance over a shallow copy of its tensordict, as
        tensordict's (through pickling's state the copy shared this one's tensordict, so
        setting a field of the copy set this one's)."""
        return self.copy()

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "_tensordict", state["_tensordict"])

    # ------------------------------------------------------------ entries
    def select(self, *keys: Any, as_tensordict: bool = False, **kwargs: Any) -> Any:
        """The fields ``keys`` (the others None): an instance of the class, or with
        ``as_tensordict=True`` a TensorDict of those entries only, as in tensordict."""
        result = self._tensordict.select(*keys, **kwargs)
        return result if as_tensordict else _wrap(self, result)

    def get(self, key: Any, default: Any = NO_DEFAULT, **kwargs: Any) -> Any:
        """The field (or nested entry) ``key``: a non-tensor field as its Python value, a
        field that holds nothing as None (or ``default``). A non-tensor below a field is
        given as its NonTensorData/NonTensorStack, as tensordict 0.15.3 gives it (so
        ``get_at`` can index it); one that is a field of a nested tensorclass, as that
        class's ``get`` gives it (its Python value). Other keywords go to the inner
        tensordict's ``get`` (``as_list=True``... of a tensorclass over a lazy stack)."""
        path = unravel_key(key)
        if len(path) == 1 and path[0] in type(self)._tc_field_names:
            # (asked of the keys: reading a ragged entry of a lazy stack without kwargs raises)
            if path[0] not in self._tensordict.keys():
                return None if default is NO_DEFAULT or default is RAISE else default
        elif len(path) == 1 and isinstance(getattr(type(self), path[0], None), property):
            return getattr(self, path[0])  # tc.get("batch_size") is tc.batch_size, as in tensordict
        elif len(path) > 1:
            # (a branch only: reading a leaf of a lazy stack would stack it; a lazy
            # stack's get gives its members' tensorclass, its _peek_str does not)
            head = _peek(self._tensordict, path[0])
            if head is not None and not _is_branch(head) and default is NO_DEFAULT:
                return None  # (a key below a leaf field: None, as tensordict's tensorclass gives)
            head = self._tensordict.get(path[0]) if _is_branch(head) else None
            if is_tensorclass(head):  # (its own get gives its non-tensor fields as values)
                return head.get(path[1:], default, **kwargs)
        value = self._tensordict.get(path, default, **kwargs)
        return value._read_value() if len(path) == 1 and is_non_tensor(value) else value

    def set(self, key: Any, value: Any, inplace: bool = False, **kwargs: Any) -> Any:
        """Set the field (or nested entry) ``key``; returns self.

        Raises:
            AttributeError: if the first part of ``key`` is not a field.
            LockedTensorDictError: if locked (use ``set_`` to write in place).
        """
        path = unravel_key(key)
        if path[0] not in type(self)._tc_field_names:
            raise AttributeError(_no_field_message(type(self), path[0]))
        if len(path) == 1 and not inplace:
            _store(self, path[0], value)
        else:
            self._tensordict.set(path, value, inplace=inplace, **kwargs)
        return self

    def update(self, input_dict_or_td: Any = None, *, inplace: bool = False, keys_to_update: Any = None,
               **kwargs: Any) -> Any:
        """Set the entries of ``input_dict_or_td`` (a dict, tensordict or tensorclass) and
        the fields given as keywords (``tc.update(other, b=...)``: the keywords win; a field
        may be named ``other``, as tensordict's parameter name leaves it free); returns self.

        Raises:
            ValueError: (before anything is written) if ``input_dict_or_td`` has keys that
                are not fields.
        """
        other = input_dict_or_td
        fields = _field_keywords(self, kwargs)
        if other is not None:
            self._update_from(other, inplace=inplace, keys_to_update=keys_to_update, **kwargs)
        if fields:
            self._update_from(fields, inplace=inplace, keys_to_update=keys_to_update, **kwargs)
        return self

    def replace(self, *args: Any, **kwargs: Any) -> Any:
        """A shallow copy (``copy()``) with some fields replaced, written with ``update``
        (nested tensordicts and tensorclasses are merged); this one does not change.
        ``tc.replace(other)``, ``tc.replace(obs=...)`` or both (the keywords win). With
        nothing to write, returns self, as tensordict does."""
        if len(args) > 1:
            raise TypeError(f"replace() takes at most one positional argument, got {len(args)}.")
        if not args and not kwargs:
            return self
        out = self.copy()
        return out.update(args[0] if args else None, **kwargs)

    def update_(self, input_dict_or_td: Any = None, **kwargs: Any) -> Any:
        """Write the entries of ``input_dict_or_td`` and the fields given as keywords into
        the existing entries, in place; returns self."""
        other = input_dict_or_td
        fields = _field_keywords(self, kwargs)
        for source in (other, fields):
            if source is not None and (not isinstance(source, dict) or source):  # (bool() of a tensorclass raises)
                self._tensordict.update_(unwrap_tensorclass(source), **kwargs)
        return self

    def _update_from(self, other: Any, *, inplace: bool, keys_to_update: Any, **kwargs: Any) -> None:
        other = unwrap_tensorclass(other)
        keys = list(other.keys())
        extra = sorted({unravel_key(k)[0] for k in keys} - type(self)._tc_field_names)
        if extra:
            raise ValueError(
                f"Keys {extra} are not fields of {type(self).__name__} (its fields are "
                f"{sorted(type(self)._tc_field_names)}); nothing was updated."
            )
        if isinstance(other, dict):
            # None into a field of its own: stored as None; into a nested key (("inner",
            # "a")): written there as any value (it was dropped, the old value kept)
            fields = [k for k, v in other.items() if v is None and isinstance(k, str)]
            for key in fields:
                _store(self, key, None)
            other = {k: v for k, v in other.items() if k not in fields}
            if not inplace:  # numbers given to int/float/bool fields, as setattr keeps them
                other = {k: _kept_number(self, k, v) if isinstance(k, str) else v for k, v in other.items()}
        self._tensordict.update(other, inplace=inplace, keys_to_update=keys_to_update, **kwargs)

    # ------------------------------------------------------------ batch indexing
    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and is_nested_key(index)):
            raise ValueError(
                f"Invalid indexing arguments: {index!r}. A tensorclass is indexed along its "
                f"batch dimensions; to read a field, use the attribute or get({index!r})."
            )
        return _wrap(self, self._tensordict[index])

    __getitems__ = __getitem__  # a DataLoader's batch of indices in one index, as tensordict

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, str) or (isinstance(index, tuple) and index and is_nested_key(index)):
            raise ValueError(
                f"Invalid indexing arguments: {index!r}. A tensorclass is indexed along its "
                f"batch dimensions; to write a field, use the attribute or set({index!r}, value)."
            )
        check_row_write(self, value)  # (nested tensorclasses: by the TensorDict's write)
        self._tensordict[index] = unwrap_tensorclass(value)

    def __iter__(self):
        return (_wrap(self, item) for item in iter(self._tensordict))  # raises at once if 0-dim

    # ------------------------------------------------------------ conversions
    def to_tensordict(self, *, retain_none: bool | None = None) -> TensorDict:
        """A TensorDict copy of the entries (nested tensorclasses become TensorDicts,
        non-tensors stay NonTensorData). Fields that hold nothing are left out, or with
        ``retain_none=True`` kept as ``NonTensorData(None)`` (nested tensorclasses' too),
        as in tensordict 0.15.3.

        Examples:
            >>> @tensorclass
            ... class Step:
            ...     obs: torch.Tensor
            ...     note: str = None
            >>> sorted(Step(obs=torch.zeros(2), batch_size=[2]).to_tensordict(retain_none=True).keys())
            ['note', 'obs']
        """
        return _plain_copy(self._tensordict, type(self)._tc_fields if retain_none else None)

    def to_dict(self, *, retain_none: bool = True) -> dict:
        """A nested dict of the fields (non-tensors as Python values, empty fields as None;
        with ``retain_none=False``, as tensordict 0.15.3, neither these nor entries
        holding None, nested ones too)."""
        out = self._tensordict.to_dict(retain_none=retain_none)
        if retain_none:
            out.update({f.name: None for f in type(self)._tc_fields if f.name not in out})
        return out

    def __repr__(self) -> str:
        from shared_td.containers.formatting import format_collection

        return format_collection(self, name=type(self).__name__)

    def _empty_fields(self) -> list:
        """The fields that hold nothing (None), in declaration order (for the repr)."""
        return [f.name for f in type(self)._tc_fields if self._tensordict._get_str(f.name, None) is None]


def _plain_copy(td: TensorDictBase, fields: Any = None) -> TensorDictBase:
    """A copy of ``td`` whose tensorclasses are TensorDicts. ``fields``: those of the
    tensorclass ``td`` is the storage of, when its empty ones (and those of the nested
    tensorclasses) are kept as ``NonTensorData(None)`` (``retain_none=True``)."""
    if not isinstance(td, TensorDict):
        return td.clone()
    out = td.clone(recurse=False)
    for key, value in list(out._tensordict.items()):
        if is_tensorclass(value):
            nested_fields = type(value)._tc_fields if fields is not None else None
            out._tensordict[key] = _plain_copy(value._tensordict, nested_fields)
        elif isinstance(value, TensorDict):
            out._tensordict[key] = _plain_copy(value)
        else:
            out._tensordict[key] = value.clone()
    for field in fields or ():
        if field.name not in out._tensordict:
            out._tensordict[field.name] = NonTensorData(None, batch_size=out.batch_size, device=out.device)
    return out


def _container_mixin_members() -> dict:
    """Methods of the mixins TensorDictBase inherits (written for every container and
    every tensorclass, e.g. the memmap family): tensorclasses get them as they are."""
    members: dict = {}
    for klass in reversed(TensorDictBase.__mro__[1:-1]):
        members.update({k: v for k, v in vars(klass).items() if not k.startswith("__")})
    return members


MEMBERS: dict[str, Any] = {
    **_container_mixin_members(),
    **{name: _forward(name, wrap=True) for name in _WRAPPED},
    **{name: _forward(name, wrap=False) for name in _PLAIN},
    **{k: v for k, v in vars(_TensorClassMembers).items()
       if k not in ("__module__", "__qualname__", "__doc__", "__dict__", "__weakref__")},
}
