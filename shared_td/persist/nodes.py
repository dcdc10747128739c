"""The node kinds: how the engine reaches a container class without importing it.

Every class that is saved as a node (a directory with a meta.json) describes itself to
the engine through one :class:`NodeKind`, registered once with :func:`register` by the
containers package (containers/node_kinds.py) when it is imported. The engine (writer,
loader, survey) deals in files and plain data only: it finds a kind by an object's class
(:func:`kind_for_object`) or by the ``_type`` of a meta.json
(:func:`kind_for_type_string`), and lets the kind read or set the container's fields.
Where a class is written, loaded and inspected is therefore one class of
containers/node_kinds.py.

A kind answers:

* **what it is**: ``name`` (one of the names below), the ``type_strings`` it owns and
  :meth:`NodeKind.matches` for the others it accepts (a tensorclass's
  ``<class 'module.Name'>``), the pickle ``side_files`` a node of it may own;
* **writing**: its keyed ``entries`` (tensors and sub-nodes, filed under their key) and
  fixed-name ``children`` (sub-directories such as ``0/`` or ``_tensordict/``), the
  ``child_type_name`` its parent records, its ``metadata`` (a node_meta.NodeMeta, whose
  ``to_json`` is the meta.json, and side files), the ``directory`` it is saved in, the
  ``stale_children`` an older save left there that a loader would take as its own;
  then ``adopt`` (memmap_: the object takes the written leaves and sub-nodes) or
  ``copy`` (memmap: a new object over them);
* **loading**: the fixed-name sub-directories a saved node has (``child_names``), and
  ``rebuild``, a new object from its checked metadata and its loaded entries/children;
* **inspecting**: ``inspect`` fills what ``shared-td inspect`` shows of a node.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Iterable

from shared_td.persist.node_meta import NodeMeta

# The names of the kinds the containers register (one per container class family).
TENSORDICT, LAZY, TENSORCLASS, NON_TENSOR_DATA, NON_TENSOR_STACK = (
    "tensordict", "lazy", "tensorclass", "non_tensor_data", "non_tensor_stack",
)


class NodeKind:
    """How one family of container classes is saved, loaded and inspected.

    Subclasses override what their nodes have; the defaults describe a node without
    entries, children or side files.
    """

    name: str = ""
    type_strings: tuple[str, ...] = ()  # the meta.json ``_type`` values of this kind
    side_files: tuple[str, ...] = ()  # pickles a node may own (removed when not rewritten)

    def matches(self, type_str: str) -> bool:
        """Whether a ``_type`` not in any kind's ``type_strings`` is this kind's."""
        return False

    def owns_class(self, cls: type) -> bool:
        """Whether instances of ``cls`` (a class not registered by name) are this kind's."""
        return False

    # ---------------------------------------------------------------- writing
    def entries(self, obj: Any) -> Iterable[tuple[str, Any]]:
        """(key, tensor or sub-node) in order: each filed under its (encoded) key."""
        return ()

    def children(self, obj: Any) -> Iterable[tuple[str, Any]]:
        """(fixed directory name, sub-node): the sub-directories that are not keys."""
        return ()

    def child_type_name(self, obj: Any) -> str:
        """What a parent's meta.json records of ``obj`` (``{"type": ...}``)."""
        raise NotImplementedError

    def metadata(self, obj: Any, entries: tuple) -> tuple[NodeMeta, dict[str, bytes]]:
        """The node's metadata (``entries``: LeafMeta/ChildMeta of its keyed entries,
        as written) and its side files (name -> bytes)."""
        raise NotImplementedError

    def stale_children(self, obj: Any, exists: Callable[[str], bool]) -> list[str]:
        """Entries of the node's directory, left by an older save, that a loader would
        read as children of ``obj`` although this write makes no such child
        (``exists(name)``: whether the directory holds ``name``). A rewrite removes them
        once the node's new files are in place. Default: none (keyed entries are read
        from meta.json only)."""
        return []

    def metadata_key(self, obj: Any) -> Hashable | None:
        """What the node's metadata depends on besides its entries, when that is plain
        data: a writer then reuses the meta.json built for an earlier node with the
        same key and entries (the nodes of a big tree are mostly alike). None (the
        default): built for each node."""
        return None

    def directory(self, obj: Any) -> str | None:
        """The directory ``obj`` was memory-mapped to or loaded from (None if none)."""
        raise NotImplementedError

    def adopt(self, obj: Any, values: dict, directory: str | None, *, share_non_tensor: bool) -> Any:
        """memmap_: ``obj`` takes the written ``values`` (key or child name -> leaf or
        built sub-node) and records ``directory``; returns ``obj``."""
        raise NotImplementedError

    def copy(self, obj: Any, values: dict, directory: str | None, *, share_non_tensor: bool) -> Any:
        """memmap/memmap_like: a new object like ``obj`` over the written ``values``."""
        raise NotImplementedError

    # ---------------------------------------------------------------- loading
    def child_names(self, meta: NodeMeta, is_directory: Callable[[str], bool]) -> list[str]:
        """The fixed-name sub-directories of a saved node, in order (FormatError
        naming the node's directory when one it needs is missing)."""
        return []

    def rebuild(self, meta: NodeMeta, values: dict, *, directory: str,
                parent_batch: tuple | None, unpickle: Callable[[str], Any], read_only: str | None = None) -> Any:
        """A new object from ``meta`` and the loaded ``values`` (keyed entries in order,
        then fixed children by name); ``parent_batch``: the parent's batch size when
        it records one; ``unpickle(name)`` reads a side file (refused unless allowed);
        ``read_only``: why the node may not be written in place (mode="r", an archive),
        for the values that are not tensors (the tensors carry their own), else None."""
        raise NotImplementedError

    # ---------------------------------------------------------------- inspecting
    def inspect(self, meta: NodeMeta, node: Any) -> None:
        """Fill ``node`` (a survey.NodeView: the entry shown, its children) for
        ``shared-td inspect``, from metadata and file names only."""
        raise NotImplementedError


_BY_NAME: dict[str, NodeKind] = {}
_BY_TYPE: dict[str, NodeKind] = {}
_BY_CLASS: dict[type, NodeKind] = {}


def register(kind: NodeKind, *classes: type) -> NodeKind:
    """Make ``kind`` the one of ``classes`` (and their subclasses) and of its type
    strings. Called once per kind, by the containers package."""
    _BY_NAME[kind.name] = kind
    for type_str in kind.type_strings:
        _BY_TYPE[type_str] = kind
    for cls in classes:
        _BY_CLASS[cls] = kind
    return kind


def kind_named(name: str) -> NodeKind:
    return _BY_NAME[name]


def kind_for_object(obj: Any) -> NodeKind:
    """The kind of a container instance (by its class, the nearest registered one)."""
    cls = type(obj)
    kind = _BY_CLASS.get(cls)
    if kind is not None:
        return kind
    for base in cls.__mro__[1:]:
        if base in _BY_CLASS:
            return _BY_CLASS[base]
    for kind in _BY_NAME.values():
        if kind.owns_class(cls):
            return kind
    raise TypeError(
        f"Cannot memory-map a {cls.__name__}: only TensorDict, "
        "LazyStackedTensorDict, tensorclass instances and non-tensor data can be."
    )


def kind_for_type_string(type_str: str) -> NodeKind:
    """The kind of a saved node, by its meta.json ``_type``."""
    kind = _BY_TYPE.get(type_str)
    if kind is not None:
        return kind
    for kind in _BY_NAME.values():
        if kind.matches(type_str):
            return kind
    raise RuntimeError(f"No node kind reads a {type_str!r}: import shared_td.containers first.")


def node_document(obj: Any, kind: NodeKind, entries: tuple = ()) -> tuple[bytes, dict[str, bytes]]:
    """The meta.json bytes of a node and the side files it needs (pickles)."""
    meta, side = kind.metadata(obj, entries)
    return meta.to_json(), side


def side_files(kind: NodeKind | str) -> tuple[str, ...]:
    """Pickle side files a node kind (or the kind of that name) may own."""
    return (kind_named(kind) if isinstance(kind, str) else kind).side_files
