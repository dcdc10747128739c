"""Legacy (robust_key=False) names and the options of load_memmap / load_memmap_.

Each behaviour is compared with tensordict 0.15.3 side by side when it is installed
(those cases skip otherwise, as tests/interop does).
"""
from __future__ import annotations

import os

import pytest
import torch

from persist_helpers import TensorDict, assert_same_values, dir_state

try:
    import tensordict
except ImportError:  # the comparisons skip; our own behaviour is still tested
    tensordict = None
needs_tensordict = pytest.mark.skipif(
    tensordict is None or tensordict.__version__ != "0.15.3",
    reason="compares with tensordict 0.15.3, which is not installed: "
    "pip install 'tensordict==0.15.3' (the test extra)",
)


def files(path) -> set[str]:
    return {os.path.relpath(os.path.join(root, name), path)
            for root, _, names in os.walk(path) for name in names}


# ------------------------------------------------- robust_key=False: the names Linux allows
# One file name on Linux: anything but '/' and NUL; '.', '..' and '' only as leaves (where
# '.memmap' is appended).
LINUX_NAMES = ["x:y", "c:d", "a\\b", "C:\\tmp", 'q"<>|?*', "tab\there"]


def legacy_td(lib):
    data = {k: torch.full((2,), float(i)) for i, k in enumerate(LINUX_NAMES + [".", "..", ""])}
    data["d:ir"] = {"in\\side": torch.ones(2)}
    return lib.TensorDict(data, [2])


def test_legacy_names_are_written_raw_on_linux(tmp_path):
    td = legacy_td(__import__("shared_td"))
    td.memmap_(tmp_path / "p", robust_key=False)
    assert files(tmp_path / "p") == {
        "meta.json", "x:y.memmap", "c:d.memmap", "a\\b.memmap", "C:\\tmp.memmap",
        'q"<>|?*.memmap', "tab\there.memmap", "..memmap", "...memmap", ".memmap",
        "d:ir/meta.json", "d:ir/in\\side.memmap",
    }
    assert_same_values(TensorDict.load_memmap(tmp_path / "p", robust_key=False), td)
    assert_same_values(TensorDict.load_memmap(tmp_path / "p"), td)  # raw names are found


@pytest.mark.parametrize("key", ["a/b", "../x", "/abs", "nul\x00byte"])
@pytest.mark.parametrize("as_collection", [False, True])
def test_legacy_refuses_what_is_not_one_name(tmp_path, key, as_collection):
    value = TensorDict({"leaf": torch.ones(2)}, [2]) if as_collection else torch.ones(2)
    td = TensorDict({"ok": torch.zeros(2), key: value}, [2])
    with pytest.raises(ValueError, match="robust_key=True") as info:
        td.memmap_(tmp_path / "p", robust_key=False)
    assert repr(key) in str(info.value)
    assert dir_state(tmp_path) == {}


@pytest.mark.parametrize("key", [".", "..", ""])
def test_legacy_refuses_dot_names_as_directories(tmp_path, key):
    td = TensorDict({key: TensorDict({"leaf": torch.ones(2)}, [2])}, [2])
    with pytest.raises(ValueError, match="robust_key=True"):
        td.memmap_(tmp_path / "p", robust_key=False)
    assert dir_state(tmp_path) == {}


@needs_tensordict
def test_legacy_names_equal_tensordict(tmp_path):
    import shared_td
    legacy_td(shared_td).memmap(tmp_path / "ours", robust_key=False)
    theirs = legacy_td(tensordict)
    del theirs["."], theirs[".."], theirs[""]  # tensordict would write these wrongly
    theirs.memmap(tmp_path / "theirs", robust_key=False)
    assert files(tmp_path / "theirs") <= files(tmp_path / "ours")
    assert files(tmp_path / "ours") - files(tmp_path / "theirs") == {
        "..memmap", "...memmap", ".memmap"}
    back = tensordict.TensorDict.load_memmap(tmp_path / "ours", robust_key=False)
    assert back["x:y"].tolist() == [0.0, 0.0] and back["d:ir", "in\\side"].tolist() == [1.0, 1.0]
    mine = TensorDict.load_memmap(tmp_path / "theirs", robust_key=False)
    assert_same_values(mine, theirs)
