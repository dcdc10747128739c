"""Functions that tests/containers/test_map.py gives to ``map``/``map_iter``.

In a module of their own, importable by name, so that spawn workers (which import the
function instead of inheriting it) find them; each works on shared_td's and tensordict's
chunks alike.
"""
import os
import signal
import time

import torch


def double(chunk):
    return chunk.apply(lambda x: x * 2)


def nothing(chunk):
    return None


def obs_sum(chunk):
    """A tensor result: one value per row."""
    return chunk["obs"].sum(-1)


def random_rows(chunk):
    """Rows drawn from the worker's torch generator (seeded by map)."""
    return chunk.empty().set("r", torch.rand(chunk.batch_size))


def fails_on_row_3(chunk):
    if (chunk["row"] == 3).any():
        raise ValueError("row 3 is refused by fn")
    return chunk


def killed_on_row_3(chunk):
    if (chunk["row"] == 3).any():
        os.kill(os.getpid(), signal.SIGKILL)
    return chunk


def slow(chunk):
    time.sleep(0.2)
    return chunk.clone()


def steps_class(lib):
    """A tensorclass of ``lib`` defined at the top of this module (picklable by name)."""
    if lib.__name__ not in _STEPS:
        _STEPS[lib.__name__] = _make_steps(lib)
    return _STEPS[lib.__name__]


_STEPS: dict = {}


def _make_steps(lib):
    @lib.tensorclass
    class Steps:
        obs: torch.Tensor

    Steps.__qualname__ = Steps.__name__ = f"Steps_{lib.__name__}"
    globals()[Steps.__name__] = Steps  # (found by name when a chunk is unpickled)
    return Steps


def pid_file_then_sleep(chunk):
    """Write this worker's pid into the directory named by the chunk's ``dir`` value,
    then compute for a long time (a chunk whose caller dies meanwhile)."""
    directory = chunk.get_non_tensor("dir")
    with open(os.path.join(directory, f"{os.getpid()}.pid"), "w"):
        pass
    time.sleep(120)
    return chunk


def slower_first(chunk):
    """The first rows take longest: their results arrive after the later ones'."""
    time.sleep(0.3 if (chunk["row"] < 2).any() else 0.0)
    return chunk.clone()


class SlowToSend:
    """A value that takes a while to pickle: a result sent after its chunk was done."""

    def __reduce__(self):
        time.sleep(1.5)
        return (SlowToSend, ())


def slow_to_send(chunk):
    result = chunk.clone()
    result.set_non_tensor("slow", SlowToSend())
    return result
