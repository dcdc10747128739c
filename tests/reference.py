"""tensordict 0.15.3, the reference the side-by-side tests compare with.

It is a test dependency (the ``test`` extra); where it is missing or another version,
the comparisons skip (saying how to install it) and shared_td's own halves still run.
"""
from __future__ import annotations

import pytest

try:
    import tensordict
except ImportError:
    tensordict = None

needs_tensordict = pytest.mark.skipif(
    tensordict is None or tensordict.__version__ != "0.15.3",
    reason="compares with tensordict 0.15.3, which is not installed: "
    "pip install 'tensordict==0.15.3' (the test extra)",
)
