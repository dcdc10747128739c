"""``@tensorclass``: dataclasses whose fields live in a TensorDict (tensordict 0.15.3's API).

The decorator keeps the class (and its methods) and adds to it:

* a data descriptor per field: reading gives the tensor, the nested collection, the
  plain Python value of a non-tensor, or None for a field that holds nothing; writing
  goes through ``set`` (so a locked instance refuses it like a TensorDict does);
* a generated ``__init__(<fields>, *, batch_size=None, device=None, names=None)``;
* the tensordict API, forwarded to the inner ``_tensordict`` (see
  ``tensorclass_members``).

A member is only added when the class (or a base other than ``object``) does not
define that name already, so user methods win over forwarded ones.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import inspect
import types
import typing
from typing import Any

from shared_td.containers.base import is_non_tensor
from shared_td.containers.tensordict import TensorDict
from shared_td.containers.tensorclass_init import in_init, make_init, note_assigned, wrap_user_init
from shared_td.containers.tensorclass_members import MEMBERS, _store, is_tensorclass
from shared_td.tensorclass_protocol import mark_tensorclass

__all__ = ["TensorClass", "from_dataclass", "tensorclass", "is_tensorclass", "tensorclass_for_type_string"]

_REGISTRY: dict[str, type] = {}
_MISSING = dataclasses.MISSING


# ------------------------------------------------------------------------ registry
def _register(cls: type) -> None:
    _REGISTRY[str(cls)] = cls


# The tensorclass whose load_memmap/load_memmap_ is running (see loading_as).
_LOADING_AS: contextvars.ContextVar[type | None] = contextvars.ContextVar("shared_td_loading_as", default=None)


@contextlib.contextmanager
def loading_as(cls: type):
    """While ``cls.load_memmap`` (or an instance's ``load_memmap_``) runs: a class saved
    from ``__main__`` under ``cls``'s qualname is ``cls``, as in tensordict 0.15.3. A
    script or notebook records its classes as ``__main__.<qualname>``, a name another
    program cannot define; the class the load is called on says which one is meant."""
    token = _LOADING_AS.set(cls)
    try:
        yield
    finally:
        _LOADING_AS.reset(token)


def loading_class() -> type | None:
    """The class whose ``load_memmap`` runs now (see :func:`loading_as`), or None."""
    return _LOADING_AS.get()


def tensorclass_for_type_string(type_string: str) -> type:
    """The tensorclass whose ``str(cls)`` is ``type_string`` (e.g. ``"<class 'pkg.mod.X'>"``,
    as tensordict writes in ``meta.json``); inside ``loading_as(cls)``, also ``cls`` for
    ``"<class '__main__.<cls.__qualname__>'>"``.

    Only classes already defined in this process are found: loading data never imports
    a module named in a file (that would run code chosen by whoever wrote the file).

    Raises:
        KeyError: if no such tensorclass has been defined.
    """
    if type_string in _REGISTRY:
        return _REGISTRY[type_string]
    loading = _LOADING_AS.get()
    if loading is not None and type_string == f"<class '__main__.{loading.__qualname__}'>":
        return loading
    raise KeyError(
        f"No tensorclass {type_string!r} is defined: import (or define) the module that "
        "declares it with @tensorclass before loading the data."
    )


# ------------------------------------------------------------------------ decorator
def tensorclass(
    cls: type | None = None,
    /,
    *,
    autocast: bool = False,
    frozen: bool = False,
    nocast: bool = False,
    shadow: bool = False,
    tensor_only: bool = False,
    skip_post_init_on_rebuild: bool = False,
    cast_filter: Any = None,
    kw_only: bool = False,
):
    """Turn a class with annotated fields into a tensorclass (``@tensorclass`` or
    ``@tensorclass(frozen=True, ...)``).

    Keyword Args:
        frozen: assigning a field raises ``dataclasses.FrozenInstanceError`` and
            instances are locked (in-place writes such as ``x.obs[0] = 1`` still work).
        nocast: values that are not tensors nor tensor collections (ints, lists,
            arrays...) are kept as Python values (NonTensorData) instead of tensors.
        shadow: allow fields named like a tensorclass member (``clone``...), which
            they then hide.
        skip_post_init_on_rebuild: run ``__post_init__`` only when an instance is
            built by ``__init__``/``from_tensordict``, not on indexing, clone, stack...
        kw_only: the fields are keyword-only arguments of ``__init__``.
        autocast, tensor_only, cast_filter: not supported (TypeError when set).

    Examples:
        >>> @tensorclass
        ... class Obs:
        ...     pixels: torch.Tensor
        ...     task: str = "walk"
        >>> x = Obs(torch.zeros(3, 2), batch_size=[3])
        >>> x[0].task, x[1:].batch_size
        ('walk', torch.Size([2]))
    """
    if autocast and nocast:
        raise TypeError("autocast is exclusive with nocast.")
    if tensor_only and (autocast or nocast):
        raise TypeError("tensor_only and autocast or nocast are exclusive features.")
    for option, value in (("autocast", autocast), ("tensor_only", tensor_only), ("cast_filter", cast_filter)):
        if value is not False and value is not None:
            raise TypeError(
                f"shared_td's tensorclass does not support the option {option}={value!r}: "
                "remove it and convert field values yourself before setting them."
            )
    options = dict(
        frozen=bool(frozen), nocast=bool(nocast), shadow=bool(shadow),
        skip_post_init=bool(skip_post_init_on_rebuild), kw_only=bool(kw_only),
    )

    def decorate(klass: type) -> type:
        return _make_tensorclass(klass, **options)

    return decorate if cls is None else decorate(cls)


# ------------------------------------------------------------------------ class form
#: the options of the bracket form ``TensorClass["nocast", "frozen"]``, as in tensordict
_FLAGS = ("autocast", "nocast", "frozen", "tensor_only", "shadow", "skip_post_init_on_rebuild")
#: class attribute that holds each inherited option
_FLAG_ATTRIBUTES = {"frozen": "_frozen", "nocast": "_nocast", "shadow": "_shadow",
                    "skip_post_init_on_rebuild": "_skip_post_init_on_rebuild"}


class TensorClass:
    """The class form of ``@tensorclass``: every subclass is a tensorclass.

    Options are keywords of the class statement (``class Step(TensorClass,
    frozen=True)``) or flags in brackets (``class Step(TensorClass["nocast"])``); a
    subclass of a subclass inherits them and adds its own fields.

    Examples:
        >>> class Step(TensorClass):
        ...     obs: torch.Tensor
        ...     task: str = "walk"
        >>> Step(obs=torch.zeros(3, 2), batch_size=[3])[0].task
        'walk'
    """

    _is_tensorclass = True
    _autocast = _nocast = _frozen = False  # the options' defaults, read as in tensordict
    # cls.load_memmap of a save of a plain tensordict gives a cls (as tensordict 0.15.3
    # does for TensorClass subclasses only; a @tensorclass gives the TensorDict)
    _tc_wraps_plain_loads = True

    def __init_subclass__(cls, *, autocast: bool = False, frozen: bool | None = None,
                          nocast: bool | None = None, shadow: bool | None = None,
                          tensor_only: bool = False, skip_post_init_on_rebuild: bool | None = None,
                          cast_filter: Any = None, kw_only: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("_tc_flags_only"):  # TensorClass["..."]: options, no fields
            return
        given = dict(frozen=frozen, nocast=nocast, shadow=shadow,
                     skip_post_init_on_rebuild=skip_post_init_on_rebuild)
        options = {name: bool(getattr(cls, _FLAG_ATTRIBUTES[name], False)) if value is None else value
                   for name, value in given.items()}
        tensorclass(autocast=autocast, tensor_only=tensor_only, cast_filter=cast_filter,
                    kw_only=kw_only, **options)(cls)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # the base (and TensorClass["..."]) has no fields: an instance of it holds nothing,
        # so it is refused, as in tensordict 0.15.3
        if cls is TensorClass or cls.__dict__.get("_tc_flags_only"):
            raise NotImplementedError(
                f"{cls.__name__} is a base class and cannot be instantiated: subclass it with "
                "fields (class Step(TensorClass): obs: torch.Tensor) and instantiate the subclass.")
        return super().__new__(cls)

    def __class_getitem__(cls, item: Any) -> type:
        flags = item if isinstance(item, tuple) else (item,)
        unknown = [flag for flag in flags if not isinstance(flag, str) or flag not in _FLAGS]
        if unknown and getattr(cls, "__parameters__", ()):
            # a generic tensorclass (class Base(TensorClass, Generic[T])): Base[int]
            return super().__class_getitem__(item)
        if unknown:
            raise TypeError(f"TensorClass is not a generic class, so TensorClass[...] only accepts "
                            f"the flags {_FLAGS}, got {unknown}.")
        tensorclass(**{flag: True for flag in flags})  # refuses what the decorator refuses
        namespace = {"_tc_flags_only": True, "__module__": cls.__module__}
        namespace.update({_FLAG_ATTRIBUTES[flag]: True for flag in flags if flag in _FLAG_ATTRIBUTES})
        return type(f"TensorClass_{'_'.join(flags)}", (cls,), namespace)


# ------------------------------------------------------------------------ from_dataclass
def from_dataclass(obj: Any, *, dest_cls: type | None = None, auto_batch_size: bool = False,
                   batch_dims: int | None = None, batch_size: Any = None, frozen: bool = False,
                   autocast: bool = False, nocast: bool = False, inplace: bool = False,
                   shadow: bool = False, tensor_only: bool = False, device: Any = None) -> Any:
    """A tensorclass from a dataclass type, or a tensorclass instance from a dataclass
    instance (tensordict 0.15.3's ``from_dataclass``).

    For a type: a new tensorclass ``<name>_tc`` with the same fields, or the type
    itself made a tensorclass with ``inplace=True``; a tensorclass is returned as it is.
    For an instance: an instance of a new ``<name>_tc`` tensorclass (or of
    ``dest_cls``) built from the fields (copied, as ``dataclasses.asdict`` does), with
    ``batch_size`` or, with ``auto_batch_size=True``, the longest leading shape the
    entries share (at most ``batch_dims`` dims).

    Raises:
        TypeError: if ``obj`` is not a dataclass, if ``auto_batch_size`` is given with
            ``batch_size``, or for options that ``@tensorclass`` refuses.

    Examples:
        >>> @dataclasses.dataclass
        ... class X:
        ...     a: int
        ...     b: torch.Tensor
        >>> from_dataclass(X(0, torch.zeros(3))).b.shape
        torch.Size([3])
    """
    options = dict(frozen=frozen, autocast=autocast, nocast=nocast, shadow=shadow, tensor_only=tensor_only)
    if isinstance(obj, type):
        if is_tensorclass(obj):
            return obj
        if not dataclasses.is_dataclass(obj):
            raise TypeError(f"from_dataclass() needs a dataclass type or instance, got {obj!r}.")
        if inplace:
            _drop_generated_methods(obj)
            return tensorclass(**options)(obj)
        fields = [(f.name, f.type, copy.copy(f)) for f in dataclasses.fields(obj)]
        made = dataclasses.make_dataclass(f"{obj.__name__}_tc", fields, bases=obj.__bases__,
                                          init=False, repr=False, eq=False)
        made.__module__ = obj.__module__
        return tensorclass(**options)(made)
    if not dataclasses.is_dataclass(obj):
        raise TypeError(f"from_dataclass() needs a dataclass type or instance, got a {type(obj).__name__}.")
    if auto_batch_size and batch_size is not None:
        raise TypeError("from_dataclass(): give batch_size or auto_batch_size=True, not both.")
    cls = dest_cls if dest_cls is not None else from_dataclass(type(obj), **options)
    result = cls(**dataclasses.asdict(obj), batch_size=batch_size, device=device)
    if auto_batch_size:
        result.auto_batch_size_(batch_dims=batch_dims)
    return result


def _drop_generated_methods(cls: type) -> None:
    """Remove the ``__init__``, ``__repr__`` and ``__eq__`` that ``@dataclass`` wrote, so
    that the tensorclass ones take their place (methods the user wrote stay)."""
    for name in ("__init__", "__repr__", "__eq__"):
        method = vars(cls).get(name)
        if method is None:
            continue
        # dataclasses compiles the methods it writes from source text ("<string>"); its
        # __repr__ is wrapped against recursion
        code = getattr(inspect.unwrap(method), "__code__", None)
        if getattr(code, "co_filename", None) == "<string>":
            delattr(cls, name)


def _make_tensorclass(cls: type, *, frozen, nocast, shadow, skip_post_init, kw_only) -> type:
    if not isinstance(cls, type):
        raise TypeError(f"@tensorclass decorates a class, got {cls!r}.")
    _restore_field_declarations(cls)
    dataclasses.dataclass(cls, init=False, repr=False, eq=False, kw_only=kw_only)
    fields = tuple(dataclasses.fields(cls))
    if not shadow:
        reserved = _reserved_names()
        for field in fields:
            if field.name in reserved:
                raise AttributeError(
                    f"Attribute name {field.name} can't be used with @tensorclass (field "
                    f"{field.name!r} of {cls.__name__}): tensorclasses have a member of that "
                    "name; rename the field, or pass shadow=True to let the field hide the member."
                )
    for field in fields:
        setattr(cls, field.name, _FieldAttribute(field))
    defined = {name for klass in cls.__mro__ if klass is not object for name in vars(klass)}
    for name, member in MEMBERS.items():
        if name not in defined:
            setattr(cls, name, member)
    if "__init__" in vars(cls):
        cls.__init__ = wrap_user_init(cls.__init__, frozenset(f.name for f in fields))
    elif not getattr(cls.__init__, "_tc_wrapped", False):
        # (a subclass without an __init__ of its own runs its base's own one, as in tensordict)
        cls.__init__ = make_init(cls, fields)
    own = vars(cls)
    # dataclass's rule: a __hash__ the class body writes is kept, unless it is the None
    # that Python sets on a class whose body defines __eq__
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    if frozen and not explicit_hash:
        # as @dataclass(frozen=True) in tensordict: hash the tuple of the field values
        # (a tensor hashes by identity), so a frozen instance can be a dict key
        cls.__hash__ = _frozen_hash
    elif "__hash__" not in defined or (not explicit_hash and getattr(cls, "__hash__", None) is _frozen_hash):
        # fields can change: unhashable, as a non-frozen dataclass with eq (also when
        # the class derives from a frozen tensorclass)
        cls.__hash__ = None
    mark_tensorclass(cls)
    cls._tc_fields = fields
    cls._tc_field_names = frozenset(f.name for f in fields)
    cls._frozen, cls._nocast, cls._shadow = frozen, nocast, shadow
    cls._autocast = False  # read by code written for tensordict; never set here (see tensorclass)
    # tensordict's name for the set of field names
    cls.__expected_keys__ = {f.name for f in fields}
    cls._tc_scalar_fields = _scalar_fields(cls, fields)
    cls._skip_post_init_on_rebuild = skip_post_init
    _register(cls)
    return cls


def _restore_field_declarations(cls: type) -> None:
    """Put back the ``field(...)`` of each field that ``cls`` itself declares, when
    ``cls`` is already a dataclass (``@tensorclass`` over ``@dataclass``, from_dataclass).

    ``@dataclass`` replaces a ``field()`` class attribute by its default, or deletes it
    when it has a default_factory: decorating the class again would read such a field as
    required, with repr, metadata and kw_only lost.
    """
    declared = vars(cls).get("__dataclass_fields__")
    if not declared:
        return
    for name in vars(cls).get("__annotations__", {}):
        old = declared.get(name)
        if old is None or old._field_type is not dataclasses._FIELD:  # ClassVar, InitVar
            continue
        setattr(cls, name, dataclasses.field(
            default=old.default, default_factory=old.default_factory, init=old.init,
            repr=old.repr, hash=old.hash, compare=old.compare, metadata=old.metadata,
            kw_only=old.kw_only,
        ))


def _frozen_hash(self) -> int:
    """The ``__hash__`` of a frozen tensorclass: the hash of the tuple of its field
    values, the fields dataclass hashes (``hash=True``, or ``hash=None`` and compare)."""
    fields = type(self)._tc_fields
    return hash(tuple(getattr(self, f.name) for f in fields if (f.compare if f.hash is None else f.hash)))


def _scalar_fields(cls: type, fields: tuple) -> dict:
    """field name -> the Python number types it keeps as they are (see ``_store``): the
    fields annotated ``int``, ``float`` (an int is a valid float) or ``bool``, alone or
    in an Optional/Union of them. Unresolvable annotations give none."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a forward reference that does not resolve: no scalar fields
        return {}
    out = {}
    for field in fields:
        hint = hints.get(field.name)
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        args = [a for a in args if a is not type(None)]
        if args and all(a in (int, float, bool) for a in args):
            out[field.name] = tuple({int, *args} if float in args else args)
    return out


def _reserved_names() -> set:
    # (``data`` is TensorDict's but no tensorclass member: a field may be named so, as
    # in tensordict, where NonTensorData's value is its field ``data``)
    names = {n for n in dir(TensorDict) if not n.startswith("_")} - {"data"}
    return names | {n for n in MEMBERS if not n.startswith("__")} | {"_tensordict"}


class _FieldAttribute:
    """The data descriptor of one field: the value lives in ``obj._tensordict``."""

    def __init__(self, field: dataclasses.Field):
        self.name = field.name
        self.field = field

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            if self.field.default is not _MISSING:
                return self.field.default
            raise AttributeError(f"Field {self.name!r} of {owner.__name__} has no class-level default.")
        value = obj._tensordict._get_str(self.name, None)
        return value._read_value() if is_non_tensor(value) else value

    def __set__(self, obj: Any, value: Any) -> None:
        if type(obj)._frozen and not in_init(obj):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {self.name!r}")
        _store(obj, self.name, value)
        note_assigned(obj, self.name)

    def __delete__(self, obj: Any) -> None:
        self.__set__(obj, None)
