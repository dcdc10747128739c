"""Child-process targets and values for tests/persist/test_share_non_tensor.py.

A module of its own, importable by name, so that spawn children (which import the
target instead of inheriting it) find it; ``Point`` lives here for the same reason.
"""
from __future__ import annotations

import torch

from shared_td import NonTensorData, NonTensorStack, TensorDict


class Point:
    """A custom picklable value."""

    def __init__(self, x: int, y: int):
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return type(other) is Point and (self.x, self.y) == (other.x, other.y)

    def __repr__(self) -> str:
        return f"Point({self.x}, {self.y})"


# key -> (value before, value the writer child writes); every type the contract names
VALUES = {
    "s": ("walk", "ünïcödé → 步行 " * 12),  # > 100 bytes (tensordict truncates at 100)
    "i": (1, -7),
    "b": (True, False),
    "f": (0.5, 2.25),
    "l": (["a"], [1, "two", [3.0]]),
    "d": ({"k": 1}, {"k": [2], "z": None}),
    "n": ("not none", None),
    "by": (b"old", b"\x00\xffnew"),
    "obj": (Point(0, 0), Point(3, -4)),
}
STACK_BEFORE, STACK_AFTER = ["a", "b", "c"], ["a", "Ω" * 60, "c"]


def make_td() -> TensorDict:
    """Every value of VALUES as a NonTensorData, a nested one, a stack and a tensor."""
    td = TensorDict(
        {key: NonTensorData(before, batch_size=[3]) for key, (before, _) in VALUES.items()},
        batch_size=[3],
    )
    td["sub"] = TensorDict(task=NonTensorData("inner", batch_size=[3]), batch_size=[3])
    td["st"] = NonTensorStack(*STACK_BEFORE)
    td["obs"] = torch.zeros(3)
    return td


def write_all(tds) -> None:
    """Write every new value in place, each key by a different route."""
    new = {key: after for key, (_, after) in VALUES.items()}
    for td in tds:
        for key in ("s", "f", "n"):
            td.set_(key, new[key])
        td.set("by", new["by"], inplace=True)
        td.set_("obj", NonTensorData(new["obj"], batch_size=[3]))
        td.update_({"i": new["i"], "b": new["b"]})
        td.update_({"d": NonTensorData(new["d"]), "l": NonTensorData(new["l"])})  # (a list alone: one value per element)
        td.set_(("sub", "task"), "inner, rewritten")
        td[1] = {"st": STACK_AFTER[1]}  # one element of the stack
        td["obs"][0] = 1.0


def snapshot(td) -> dict:
    """key -> (type name, value) of every non-tensor entry and the tensor."""
    out = {key: td[key] for key in VALUES}
    out["sub.task"], out["st"], out["obs"] = td["sub", "task"], td["st"], td["obs"].tolist()
    return out


def read_all(tds, queue) -> None:
    queue.put([snapshot(td) for td in tds])


def write_one(td, key, value) -> None:
    td.set_(key, value)


def write_element(td, index, value) -> None:
    td[index] = {"st": value}


def concurrent_value(writer: int, i: int) -> str:
    """Distinct values of distinct lengths, so that a torn read cannot pass as one."""
    return f"{writer}:{i}:" + chr(ord("a") + writer) * (2000 + 37 * i)


def parse_value(value: str) -> tuple[int, int]:
    writer, i, rest = value.split(":", 2)
    assert value == concurrent_value(int(writer), int(i)), "torn or unknown value"
    return int(writer), int(i)


def concurrent_writer(td, writer: int, count: int, start) -> None:
    start.wait(30)
    for i in range(count):
        td.set_("task", concurrent_value(writer, i))


def concurrent_reader(td, stop, queue) -> None:
    """Read until ``stop``; report the number of reads and any bad one."""
    reads, last, error = 0, {}, None
    while not stop.is_set() or reads == 0:
        value = td["task"]
        reads += 1
        if value == "start":
            continue
        try:
            writer, i = parse_value(value)
            assert i >= last.get(writer, -1), f"writer {writer} went back from {last[writer]} to {i}"
            last[writer] = i
        except Exception as err:  # report, keep the parent from waiting
            error = f"{err!r} on a value of length {len(value)}: {value[:40]!r}"
            break
    queue.put((reads, error))


def element_writer(td, element: int, count: int, start) -> None:
    start.wait(30)
    for i in range(count):
        td[element] = {"st": f"{element}:{i}"}


def write_stacks_directly(writes) -> None:
    """``stack[index] = value`` for each ``(stack, index, value)``: NonTensorStacks
    received on their own."""
    for stack, index, value in writes:
        stack[index] = value


def read_entries(tds, queue) -> None:
    queue.put([{key: td[key] for key in td.keys()} for td in tds])
