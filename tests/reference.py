"""tensordict 0.15.3, the reference the side-by-side tests compare with.

It is a test dependency (the ``test`` extra); where it is missing or another version,
the comparisons skip (saying how to install it) and shared_td's own halves still run.
"""
from __future__ import annotations

import warnings

import pytest

import shared_td

try:
    import tensordict
except ImportError:
    tensordict = None

needs_tensordict = pytest.mark.skipif(
    tensordict is None or tensordict.__version__ != "0.15.3",
    reason="compares with tensordict 0.15.3, which is not installed: "
    "pip install 'tensordict==0.15.3' (the test extra)",
)

#: Both libraries as pytest parameters, for a test run once with each: shared_td, and
#: tensordict 0.15.3 where it is installed.
LIBS = [
    pytest.param(shared_td, id="shared_td"),
    pytest.param(tensordict, id="tensordict", marks=needs_tensordict),
]


def dim_names(value):
    """``value.names`` in shared_td's convention: None when no dim is named (tensordict
    gives a list of None)."""
    names = getattr(value, "names", None)
    return None if names is None or all(n is None for n in names) else list(names)


def outcome(fn):
    """What ``fn()`` gives, warnings silenced: its result, or "error" for the exceptions
    tensordict raises (shared_td's errors derive from them)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn()
    except (RuntimeError, ValueError, IndexError, TypeError, KeyError):
        return "error"


def side_by_side(scenario):
    """``scenario(library)`` gives the same outcome on shared_td and on tensordict."""
    import shared_td

    ours, theirs = outcome(lambda: scenario(shared_td)), outcome(lambda: scenario(tensordict))
    assert ours == theirs
