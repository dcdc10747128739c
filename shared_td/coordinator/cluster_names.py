"""Where does a name that is not replicated live? Records of the nodes' own publications.

A name published on a node's Coordinator without ``replicate=True`` lives only on that
node. So that an ``attach`` of it on another node fails with a KeyError that says where
it is (and the fix) instead of a bare "unknown name", each node records its unreplicated
names in the cluster store (``local/<name>/<node>``, signed like every value) and removes
the record when it unpublishes the name. One store round trip per publish or unpublish;
the lookup, one per node, happens only on the error path.
"""
from __future__ import annotations

__all__ = ["LocalNames"]


class LocalNames:
    """This node's records of its unreplicated names.

    Args:
        store: the node's SignedStore.
        node, nodes: this node's number and the number of nodes.
    """

    def __init__(self, store, node: int, nodes: int):
        self._store, self._node, self._nodes = store, node, nodes

    def record(self, name: str) -> None:
        """This node's Coordinator published ``name`` without replicating it."""
        self._store.set_json(f"local/{name}/{self._node}", {"node": self._node})

    def forget(self, name: str) -> None:
        """This node's Coordinator unpublished ``name``."""
        self._store.delete(f"local/{name}/{self._node}")

    def error(self, name: str, err: KeyError) -> KeyError:
        """The KeyError for ``name``, unknown on this node: it names the nodes where it
        was published without ``replicate=True``, and the fix."""
        there = [n for n in range(self._nodes) if n != self._node and self._store.has(f"local/{name}/{n}")]
        if not there:
            return KeyError(f"{err.args[0] if err.args else name!r} Nor is it published on another node of the cluster.")
        where = ", ".join(map(str, there))
        return KeyError(
            f"{name!r} is published on node {where} without replicate=True, so it lives only "
            f"there. Publish it with replicate=True on node {there[0]} (coord.publish({name!r}, td, "
            f"replicate=True)) to attach it here, or attach it on node {where}."
        )
