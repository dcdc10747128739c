"""The saved tree as the survey reads it: entries (nodes, tensors, values) and problems.

Plain data, built by ``shared_td.persist.survey.survey`` from meta.json files only, and
printed by ``shared-td inspect`` and ``shared-td verify``.

Examples:
    >>> leaf = Entry("obs", TENSOR, "obs.memmap", dtype="torch.float32", shape=[4], nbytes=16)
    >>> Survey("/data/b", Entry("", NODE, "", children=[leaf]), []).totals()["bytes"]
    16
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: Non-tensor values are shown as their repr cut to this many characters.
VALUE_WIDTH = 60

TENSOR, NODE, VALUE = "tensor", "node", "value"


@dataclass
class Problem:
    """One thing wrong (``error``: the loader would fail) or odd (``warning``)."""

    severity: str
    path: str  # relative to the prefix; "." is the prefix itself
    message: str


@dataclass
class Entry:
    """A node, tensor leaf or non-tensor value of the saved tree."""

    key: str  # the key in its parent ("" for the root), as the user wrote it
    kind: str  # TENSOR, NODE or VALUE
    path: str  # its file or directory, relative to the prefix ("" for the root)
    class_name: str = ""  # TensorDict, LazyStackedTensorDict, NonTensorData, a tensorclass...
    batch_size: list | None = None
    dtype: str | None = None
    shape: list | None = None
    nbytes: int | None = None  # bytes that shape and dtype need (None: unknown)
    size_on_disk: int | None = None  # bytes of its file(s) (None: no file)
    value: str | None = None  # a non-tensor value, cut to VALUE_WIDTH characters
    children: list["Entry"] = field(default_factory=list)

    def walk(self):
        """This entry and every entry below it, depth first."""
        yield self
        for child in self.children:
            yield from child.walk()


@dataclass
class Survey:
    """The tree at ``prefix`` and the problems found in it."""

    prefix: str
    root: Entry
    problems: list[Problem]

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    def totals(self) -> dict:
        """Counts and bytes: ``leaves``, ``bytes`` (what the leaves need), ``bytes_on_disk``."""
        entries = list(self.root.walk())
        leaves = [e for e in entries if e.kind == TENSOR]
        return {
            "leaves": len(leaves),
            "bytes": sum(e.nbytes or 0 for e in leaves),
            "bytes_on_disk": sum(e.size_on_disk or 0 for e in leaves),
            "non_tensor_values": sum(e.kind == VALUE for e in entries),
            "nodes": sum(e.kind == NODE for e in entries),
        }
