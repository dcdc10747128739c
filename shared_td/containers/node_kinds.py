"""How each container class is written, loaded and inspected: its persist.NodeKind.

One class per family, registered once when the containers package is imported. The
engine (shared_td.persist) finds them by class or by meta.json ``_type`` and never looks
inside a container itself: every read or write of a container's fields for saving or
loading is here. The meta.json layouts are node_meta.NodeMeta's ``for_*`` constructors.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Callable

import torch

from shared_td.containers.lazy import LazyStackedTensorDict
from shared_td.containers.nontensor import NonTensorData, NonTensorStack
from shared_td.containers.nontensor_base import record_node
from shared_td.containers.tensorclass import loading_class, tensorclass_for_type_string
from shared_td.containers.tensordict import TensorDict
from shared_td.errors import FormatError
from shared_td.persist import format as fmt
from shared_td.persist import nodes
from shared_td.persist.node_meta import NodeMeta
from shared_td.persist.saved_tree import VALUE, Entry
from shared_td.persist.sub_directories import SubDirectories
from shared_td.persist.survey import NodeView
from shared_td.tensorclass_protocol import is_tensorclass

_CPU = torch.device("cpu")


def _mark_written(obj: Any, directory: str | None) -> Any:
    """The flags of a container whose leaves were just written (memory-mapped, locked
    by the caller, not in torch shared memory)."""
    obj._is_memmap = True
    obj._is_shared = False
    obj._memmap_prefix = directory
    return obj


class TensorDictKind(nodes.NodeKind):
    """A TensorDict: its keys are leaf files and sub-directories; meta.json lists them."""

    name = nodes.TENSORDICT
    type_strings = (fmt.TENSORDICT_TYPE,)

    def matches(self, type_str: str) -> bool:
        return tensordict_subclass(type_str) is not None

    def entries(self, td: TensorDict):
        return list(td._tensordict.items())

    def child_type_name(self, td: TensorDict) -> str:
        return fmt.CHILD_TYPE_NAMES[fmt.TENSORDICT_TYPE]

    def metadata(self, td: TensorDict, entries: tuple) -> tuple[NodeMeta, dict]:
        return NodeMeta.for_tensordict(td.batch_size, td.names, entries), {}

    def metadata_key(self, td: TensorDict):
        names = td.names  # what metadata() reads of td, besides the entries
        return tuple(td.batch_size), None if names is None else tuple(names)

    def directory(self, td: TensorDict) -> str | None:
        return td._memmap_prefix

    def adopt(self, td: TensorDict, values: dict, directory, *, share_non_tensor: bool) -> TensorDict:
        td._tensordict = values
        td._device = _CPU
        return _mark_written(td, directory)

    def copy(self, td: TensorDict, values: dict, directory, *, share_non_tensor: bool) -> TensorDict:
        return _mark_written(type(td)._new_unsafe(values, td.batch_size, _CPU, td.names), directory)  # (a subclass kept)

    def rebuild(self, meta: NodeMeta, values: dict, *, directory: str, parent_batch, unpickle, read_only=None) -> TensorDict:
        batch_size = torch.Size(meta.batch_size)
        device = None if meta.device is None else torch.device(meta.device)
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                continue  # its shape was checked with meta.json
            if getattr(value, "_is_non_tensor", False):
                if value.batch_size != batch_size:
                    values[key] = value = value._with_batch_size(batch_size, key)
                if value._device is None:  # (saved without one: the node's, as set() gives it, as tensordict loads it)
                    value._device = device
            else:
                fmt.check_batch_fits(meta.path, key, batch_size, value.batch_size)
        saved_type = meta.document.get("_type", fmt.TENSORDICT_TYPE)  # (a subclass's, see NodeMeta.from_json)
        cls = TensorDict if saved_type == fmt.TENSORDICT_TYPE else tensordict_subclass(saved_type) or TensorDict
        td = cls._new_unsafe(values, batch_size, device)
        if meta.names is not None:
            td.names = list(meta.names)
        td._memmap_prefix = directory
        return td

    def inspect(self, meta: NodeMeta, node: NodeView) -> None:
        node.entry.class_name = "TensorDict"
        node.entry.batch_size = list(meta.batch_size)


def tensordict_subclass(type_str: str) -> type | None:
    """The subclass of TensorDict defined in this process whose ``str()`` is ``type_str``
    (tensordict 0.15.3 writes a subclass's own ``_type``); while ``Sub.load_memmap`` runs,
    also ``Sub`` for a class saved from ``__main__`` under its qualname, as for
    tensorclasses. Never imports a module named in a file (that would run code chosen by
    whoever wrote it). None if there is no such class.

    Example:
        >>> class Steps(TensorDict):
        ...     pass
        >>> tensordict_subclass(str(Steps)) is Steps, tensordict_subclass("<class 'x.Y'>")
        (True, None)
    """
    if not type_str.startswith("<class '"):
        return None
    pending = TensorDict.__subclasses__()
    while pending:  # (only for a _type that no kind names: rare, and a few classes)
        cls = pending.pop()
        if str(cls) == type_str:
            return cls
        pending.extend(cls.__subclasses__())
    loading = loading_class()
    if (isinstance(loading, type) and issubclass(loading, TensorDict)
            and type_str == f"<class '__main__.{loading.__qualname__}'>"):
        return loading
    return None


class LazyStackKind(nodes.NodeKind):
    """A LazyStackedTensorDict: its members are the directories 0/, 1/, ..."""

    name = nodes.LAZY
    type_strings = (fmt.LAZY_STACK_TYPE,)

    def children(self, lazy: LazyStackedTensorDict):
        return [(str(index), member) for index, member in enumerate(_members_as_given(lazy))]

    def child_type_name(self, lazy: LazyStackedTensorDict) -> str:
        return fmt.CHILD_TYPE_NAMES[fmt.LAZY_STACK_TYPE]

    def stale_children(self, lazy: LazyStackedTensorDict, exists: Callable[[str], bool]) -> list[str]:
        # members are read from 0/ on while the next one exists (in both libraries): the
        # members of a longer stack saved there before would come back after this one's
        names = []
        while exists(str(len(lazy.tensordicts) + len(names))):
            names.append(str(len(lazy.tensordicts) + len(names)))
        # a member saved as a tensorclass there before and written as a tensordict now:
        # its old fields (i/_tensordict/) would stay beside the new ones
        for index, member in enumerate(_members_as_given(lazy)):
            inner = f"{index}/{fmt.TENSORCLASS_CHILD}"
            if (not is_tensorclass(member) and fmt.TENSORCLASS_CHILD not in getattr(member, "_tensordict", {})
                    and exists(inner)):
                names.append(inner)
        return names

    def metadata(self, lazy: LazyStackedTensorDict, entries: tuple) -> tuple[NodeMeta, dict]:
        # without members nothing else on disk says the batch size (tensordict skips it)
        empty_batch = None if lazy.tensordicts else lazy.batch_size
        return NodeMeta.for_lazy_stack(lazy.stack_dim, lazy._stack_dim_name, empty_batch,
                                       members=len(lazy.tensordicts)), {}

    def directory(self, lazy: LazyStackedTensorDict) -> str | None:
        return getattr(lazy, "_memmap_prefix", None)  # none if it was never memory-mapped

    def adopt(self, lazy, values: dict, directory, *, share_non_tensor: bool):
        return _mark_written(lazy, directory)  # its members adopted their leaves

    def copy(self, lazy, values: dict, directory, *, share_non_tensor: bool):
        members = [values[str(index)] for index in range(len(values))]
        # (batch_size counts only without members: then it is all there is of their shape)
        copy = type(lazy)(*members, stack_dim=lazy.stack_dim, stack_dim_name=lazy._stack_dim_name,
                          batch_size=lazy._member_batch)
        return _mark_written(copy, directory)

    def child_names(self, meta: NodeMeta, is_directory: Callable[[str], bool]) -> list[str]:
        count = meta.document.get(fmt.STACK_MEMBERS)
        if count is not None:  # shared_td's save: every member must be there
            for index in range(count):
                if not is_directory(str(index)):
                    raise FormatError(meta.path, f"member {index} of {count} of this lazy stack is "
                                      f"missing: no directory {os.path.join(_node_path(meta), str(index))}; "
                                      "the save is incomplete (restore that directory or save the stack again)",
                                      field=fmt.STACK_MEMBERS)
            return [str(index) for index in range(count)]
        names = []  # (a save of tensordict's, or of an older shared_td: no count)
        while is_directory(str(len(names))):  # the first missing member ends the stack
            names.append(str(len(names)))
        later = _member_after(len(names), is_directory)
        if later is not None:  # a gap, not the end: a member was lost
            missing = os.path.join(_node_path(meta), str(len(names)))
            raise FormatError(meta.path, f"member {len(names)} of this lazy stack is missing: no "
                              f"directory {missing}, but member {later} is there; the save "
                              "is incomplete (restore that directory or save the stack again)")
        return names  # none: a stack without members, as both libraries save one

    def rebuild(self, meta: NodeMeta, values: dict, *, directory: str, parent_batch, unpickle, read_only=None):
        members = list(values.values())
        stack_dim, member_batch = (meta.stack_dim, None) if members else _empty_stack_shape(meta, parent_batch)
        lazy = LazyStackedTensorDict(*members, stack_dim=stack_dim, stack_dim_name=meta.stack_dim_name,
                                     batch_size=member_batch)
        lazy._memmap_prefix = directory
        return lazy

    def inspect(self, meta: NodeMeta, node: NodeView) -> None:
        node.entry.class_name = "LazyStackedTensorDict"
        node.entry.children = list(node.children.values())
        if node.children:
            node.entry.batch_size = [len(node.children)]
        elif fmt.EMPTY_STACK_BATCH in meta.document:
            node.entry.batch_size = list(meta.document[fmt.EMPTY_STACK_BATCH])
        # else unknown: it depends on the parent's batch size (see _empty_stack_shape)


def _members_as_given(lazy: LazyStackedTensorDict) -> list:
    """The members of ``lazy``, each given as a tensorclass (to its constructor,
    ``append``, ``insert``, ``extend``; kept by ``clone``, pickling, slicing) as that
    tensorclass (written as a tensorclass node, as tensordict 0.15.3 writes it; a load
    gives it back so): a member replaced since is written as it is.

    Example:
        >>> @shared_td.tensorclass
        ... class Pt:
        ...     x: torch.Tensor
        >>> lazy = LazyStackedTensorDict(Pt(x=torch.zeros(2), batch_size=[2]), TensorDict(x=torch.ones(2), batch_size=[2]))
        >>> [type(member).__name__ for member in _members_as_given(lazy)], type(lazy.tensordicts[0]).__name__
        (['Pt', 'TensorDict'], 'TensorDict')
    """
    members = lazy.tensordicts
    if not getattr(lazy, "_tensorclass_members", None):
        return members
    # (the class is recorded, not the tensorclass object, which would keep a removed member
    # alive; the object is given back as the stack gives lazy[i]: no __post_init__, no lock,
    # which raised in a save of a locked stack whose class's __post_init__ assigns a field)
    return [member if (cls := lazy._tensorclass_of(member)) is None else cls._from_tensordict(member, _stored=True)
            for member in members]


def _empty_stack_shape(meta: NodeMeta, parent_batch) -> tuple[int, list]:
    """The stack dim and the members' batch size of a saved lazy stack without members.

    shared_td records the stack's batch size (EMPTY_STACK_BATCH); tensordict 0.15.3 does
    not, and loads such a stack with batch size ``[0]``. Without the record the stack
    takes the smallest batch size that fits its parent's: ``[0]`` at the top, the
    parent's own where the parent has a 0 at ``stack_dim``, else the parent's with the
    stacked 0 inserted at ``stack_dim``, lowered to the parent's dims if beyond them
    (nothing on disk tells the sizes of the dims in between; a parent with another size
    than 0 at ``stack_dim`` cannot hold the stack: its rebuild raises a FormatError).

    Example:
        >>> meta = NodeMeta.for_lazy_stack(1)
        >>> _empty_stack_shape(meta, (2,)), _empty_stack_shape(meta, None)
        ((1, [2]), (0, []))
    """
    stack_dim, recorded = meta.stack_dim, meta.document.get(fmt.EMPTY_STACK_BATCH)
    if recorded is not None:
        return stack_dim, list(recorded[:stack_dim]) + list(recorded[stack_dim + 1:])
    parent = list(parent_batch or ())
    if stack_dim < len(parent) and parent[stack_dim] == 0:
        return stack_dim, parent[:stack_dim] + parent[stack_dim + 1:]
    return min(stack_dim, len(parent)), parent


class _NonTensorKind(nodes.NodeKind):
    """What NonTensorData and NonTensorStack share: a value, in meta.json or a pickle."""

    def directory(self, value) -> str | None:
        return value._memmap_prefix

    def adopt(self, value, values: dict, directory, *, share_non_tensor: bool):
        if share_non_tensor and value._shared_value is None:
            value._share()
        _mark_written(value, directory)
        record_node(value, directory)  # which directory: a stale view's write is refused (audit 21)
        return value

    def copy(self, value, values: dict, directory, *, share_non_tensor: bool):
        return self.adopt(value.clone(), values, directory, share_non_tensor=share_non_tensor)


class NonTensorDataKind(_NonTensorKind):
    """A NonTensorData: one value, in meta.json's ``data`` or in other.pickle."""

    name = nodes.NON_TENSOR_DATA
    type_strings = (fmt.NON_TENSOR_DATA_TYPE,)
    side_files = (fmt.OTHER_PICKLE,)

    def child_type_name(self, value: NonTensorData) -> str:
        return fmt.CHILD_TYPE_NAMES[fmt.NON_TENSOR_DATA_TYPE]

    def metadata(self, value: NonTensorData, entries: tuple) -> tuple[NodeMeta, dict]:
        data = value.data
        if fmt.is_json_value(data):
            return NodeMeta.for_non_tensor_data(data, in_json=True), {}
        side = {fmt.OTHER_PICKLE: pickle.dumps({"data": data})}
        return NodeMeta.for_non_tensor_data(data, in_json=False), side

    def rebuild(self, meta: NodeMeta, values: dict, *, directory: str, parent_batch, unpickle, read_only=None):
        data = meta.document["data"] if "data" in meta.document else unpickle(fmt.OTHER_PICKLE)["data"]
        value = NonTensorData(data, batch_size=parent_batch or [])
        value._read_only_reason = read_only
        record_node(value, directory)
        return value

    def inspect(self, meta: NodeMeta, node: NodeView) -> None:
        node.entry.kind, node.entry.class_name = VALUE, "NonTensorData"
        if "data" in meta.document:
            node.entry.value = node.shown(meta.document["data"])
        else:
            node.entry.value = node.pickled(fmt.OTHER_PICKLE)


class NonTensorStackKind(_NonTensorKind):
    """A NonTensorStack: its list of values, in meta.json's ``data`` or in pickle.pkl."""

    name = nodes.NON_TENSOR_STACK
    type_strings = (fmt.NON_TENSOR_STACK_TYPE,)
    side_files = (fmt.STACK_PICKLE,)

    def child_type_name(self, stack: NonTensorStack) -> str:
        return fmt.CHILD_TYPE_NAMES[fmt.NON_TENSOR_STACK_TYPE]

    def metadata(self, stack: NonTensorStack, entries: tuple) -> tuple[NodeMeta, dict]:
        values = stack.tolist()
        if fmt.is_json_value(values):
            return NodeMeta.for_non_tensor_stack(stack.device, values, in_json=True), {}
        side = {fmt.STACK_PICKLE: pickle.dumps(values)}
        return NodeMeta.for_non_tensor_stack(stack.device, values, in_json=False), side

    def rebuild(self, meta: NodeMeta, values: dict, *, directory: str, parent_batch, unpickle, read_only=None):
        data = meta.document.get("data")
        if data == fmt.STACK_PICKLE:
            data = unpickle(fmt.STACK_PICKLE)
        stack = NonTensorStack.from_list(data)
        parent = torch.Size(parent_batch or ())
        if stack.numel() == 0 and len(parent) > stack.batch_dims and parent[: stack.batch_dims] == stack.batch_size:
            # nested lists record no dim after a 0 (a [0, 1] stack saves as []): such
            # an empty stack takes its parent's batch size, which it was saved with
            stack = NonTensorStack._from_flat([], parent)
        stack._read_only_reason = read_only
        record_node(stack, directory)
        return stack

    def inspect(self, meta: NodeMeta, node: NodeView) -> None:
        node.entry.kind, node.entry.class_name = VALUE, "NonTensorStack"
        data = meta.document.get("data")
        if data == fmt.STACK_PICKLE:
            node.entry.value = node.pickled(fmt.STACK_PICKLE)
        else:
            node.entry.value = node.shown(data)
            if isinstance(data, list):
                node.entry.batch_size = [len(data)]


class TensorClassKind(nodes.NodeKind):
    """A tensorclass: meta.json names its class; its tensordict is _tensordict/.

    Any ``_type`` no other kind owns is read as a tensorclass's (as tensordict 0.15.3
    does); its class must be defined in this process to load it (never imported).
    """

    name = nodes.TENSORCLASS
    side_files = (fmt.OTHER_PICKLE,)

    def matches(self, type_str: str) -> bool:
        return True

    def owns_class(self, cls: type) -> bool:
        return bool(getattr(cls, "_is_tensorclass", False))

    def children(self, obj: Any):
        return [(fmt.TENSORCLASS_CHILD, obj._tensordict)]

    def child_type_name(self, obj: Any) -> str:
        return type(obj).__name__

    def metadata(self, obj: Any, entries: tuple) -> tuple[NodeMeta, dict]:
        return NodeMeta.for_tensorclass(str(type(obj))), {}

    def directory(self, obj: Any) -> str | None:
        inner = getattr(obj._tensordict, "_memmap_prefix", None)  # <directory>/_tensordict
        return None if inner is None else os.path.dirname(inner)

    def adopt(self, obj: Any, values: dict, directory, *, share_non_tensor: bool) -> Any:
        return obj  # its flags are those of its tensordict, which adopted the leaves

    def copy(self, obj: Any, values: dict, directory, *, share_non_tensor: bool) -> Any:
        return type(obj)._from_tensordict(values[fmt.TENSORCLASS_CHILD])

    def child_names(self, meta: NodeMeta, is_directory: Callable[[str], bool]) -> list[str]:
        if not is_directory(fmt.TENSORCLASS_CHILD):
            try:
                tensorclass_for_type_string(meta.type)
            except (KeyError, TypeError):
                # every unknown _type is read as a tensorclass's: say so, as a save of
                # another library's class (or a damaged _type) lands here
                raise FormatError(
                    _node_path(meta), f"its class {meta.type!r} is no known tensordict class "
                    "(a tensorclass would have a _tensordict/ directory): import the module "
                    "that defines that TensorDict subclass or tensorclass (one saved from a "
                    "script or notebook, __main__, loads with <that class>.load_memmap()), "
                    "or check what wrote this save",
                ) from None
            raise FormatError(_node_path(meta), "a tensorclass without its _tensordict/ directory")
        return [fmt.TENSORCLASS_CHILD]

    def rebuild(self, meta: NodeMeta, values: dict, *, directory: str, parent_batch, unpickle, read_only=None) -> Any:
        try:
            cls = tensorclass_for_type_string(meta.type)
        except (KeyError, TypeError):
            saved_from_main = "'__main__." in meta.type  # a script's or notebook's class
            raise RuntimeError(
                f"{meta.path} holds a {meta.type!r}, which is no known tensordict class: "
                "import the module that defines that tensorclass first" + (
                    "; a class saved from a script or notebook (__main__) loads with "
                    "<that class>.load_memmap(), where that class has the same qualname."
                    if saved_from_main else ".")
            ) from None
        return cls._from_tensordict(values[fmt.TENSORCLASS_CHILD])

    def inspect(self, meta: NodeMeta, node: NodeView) -> None:
        node.entry.class_name = _class_name(meta.type)
        inner = node.children.get(fmt.TENSORCLASS_CHILD)
        if inner is None:
            return
        node.entry.batch_size, node.entry.children = inner.batch_size, inner.children
        for key, value in meta.document.items():  # non-tensor fields kept in meta.json itself
            if not key.startswith("_"):
                node.entry.children.append(Entry(key, VALUE, os.path.join(node.entry.path, fmt.META),
                                                 "field", value=node.shown(value)))
        if node.has_file(fmt.OTHER_PICKLE):
            node.entry.children.append(Entry("(other fields)", VALUE, os.path.join(node.entry.path, fmt.OTHER_PICKLE),
                                             "field", value=node.pickled(fmt.OTHER_PICKLE)))


def _member_after(missing: int, is_directory: Callable[[str], bool]) -> int | None:
    """The lowest member index above ``missing`` (the first absent one) whose directory
    is there, or None: one lost member or a hundred (a save without a member count).
    The node is listed once: by a ``SubDirectories``'s ``names`` (the survey behind
    ``shared-td verify``), or through what ``is_directory`` is bound to: the loader's
    ``Directory`` (by its descriptor) or an archive's node; for any other callable, or
    a node that cannot be listed, only the next index is looked at.

    Example:
        >>> _member_after(1, {"0", "3"}.__contains__) is None  # (a set: next index only)
        True
        >>> _member_after(1, SubDirectories({"0", "3"}.__contains__, lambda: ["0", "3"]))
        3
        >>> _member_after(1, SubDirectories(lambda name: True, lambda: ["9" * 5000, "03", "10", "7"]))
        7
    """
    holder = getattr(is_directory, "__self__", None)
    if isinstance(is_directory, SubDirectories):
        listed = is_directory.names()
        names = [str(missing + 1)] if listed is None else list(listed)
    elif hasattr(holder, "archive") and hasattr(holder, "at"):  # persist.archive.ArchiveNode
        inside = holder.at + "/" if holder.at else ""
        names = [name[len(inside):] for name in holder.archive.directories
                 if name.startswith(inside) and "/" not in name[len(inside):]]
    elif isinstance(getattr(holder, "fd", None), int):  # storage.files.Directory
        try:
            names = os.listdir(holder.fd)
        except OSError:
            names = [str(missing + 1)]
    else:
        names = [str(missing + 1)]
    # canonical indices above ``missing``, compared as digit strings ((length, text): no
    # int() of an unbounded one, which Python refuses past 4300 digits: a crafted
    # archive's name); none is longer than 19 digits (a stack has fewer members)
    after = str(missing)
    found = sorted((len(name), name) for name in names
                   if name.isascii() and name.isdigit() and len(name) <= _MAX_INDEX_DIGITS
                   and (name == "0" or name[0] != "0") and (len(name), name) > (len(after), after))
    return next((int(name) for _, name in found if is_directory(name)), None)


_MAX_INDEX_DIGITS = 19  # (2**63 has 19 digits)


def _node_path(meta: NodeMeta) -> str:
    """The node whose meta.json is ``meta.path``: its directory, or for an archive's
    member ``"x.tdz::a/meta.json"`` / ``"x.tdz::meta.json"`` the ``"x.tdz::a"`` / the
    archive itself (os.path.dirname would name the archive's parent directory)."""
    path = meta.path
    for separator in (os.sep, "::"):
        if path.endswith(separator + fmt.META):
            return path[: -len(separator + fmt.META)] or os.sep
    return os.path.dirname(path)


def _class_name(type_str: str) -> str:
    """``"<class 'module.Name'>"`` -> ``"module.Name"``, without importing anything."""
    if type_str.startswith("<class '") and type_str.endswith("'>"):
        return type_str[len("<class '"): -len("'>")]
    return "?"


nodes.register(TensorDictKind(), TensorDict)
nodes.register(LazyStackKind(), LazyStackedTensorDict)
nodes.register(NonTensorDataKind(), NonTensorData)
nodes.register(NonTensorStackKind(), NonTensorStack)
nodes.register(TensorClassKind())
