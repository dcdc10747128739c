"""On-disk interop with tensordict 0.15.3, both directions.

Every test writes a directory with one library and loads it with the other (and, where
the layout matters, writes the same data with both and compares the files they wrote).
"""
from __future__ import annotations

import fractions
import json
import os

import pytest
import torch

tensordict = pytest.importorskip(
    "tensordict",
    reason="tensordict==0.15.3 is not installed: install the test extra "
    "(pip install '.[test]') to run the interop tests",
)
if tensordict.__version__ != "0.15.3":
    pytest.skip(
        f"the interop tests compare against tensordict 0.15.3 exactly, but tensordict "
        f"{tensordict.__version__} is installed: pip install 'tensordict==0.15.3'",
        allow_module_level=True,
    )

import shared_td  # noqa: E402

LIBS = {"tensordict": tensordict, "shared_td": shared_td}
# (writer, reader)
DIRECTIONS = [
    pytest.param("shared_td", "tensordict", id="shared_td->tensordict"),
    pytest.param("tensordict", "shared_td", id="tensordict->shared_td"),
]
BATCH_SIZES = [pytest.param([], id="batch[]"), pytest.param([3], id="batch[3]"),
               pytest.param([2, 3], id="batch[2,3]")]
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128,
]
FLOAT8 = [getattr(torch, n) for n in sorted(dir(torch)) if n.startswith("float8_")]
ROBUST_KEYS = ["a/b", "with space", "50%", "c:d", "..", ".", "", "ünï☃", "back\\slash", "../up"]
SAFE_LEGACY_KEYS = ["plain", "with space", "50%", "ünï", "dots.in.name"]

from shared_td import LazyStackedTensorDict as SharedLazy


# ----------------------------------------------------------------------------- helpers
def files(path) -> set[str]:
    """Every file under ``path``, relative to it."""
    return {
        os.path.relpath(os.path.join(root, name), path)
        for root, _, names in os.walk(path) for name in names
    }


def meta_texts(path) -> dict[str, str]:
    return {
        name: open(os.path.join(path, name), encoding="utf-8").read()
        for name in files(path) if os.path.basename(name) == "meta.json"
    }


def parsed_metas(path) -> dict[str, tuple]:
    """Every meta.json parsed, with its key order (recursively)."""
    def ordered(obj):
        if isinstance(obj, dict):
            return [(k, ordered(v)) for k, v in obj.items()]
        if isinstance(obj, list):
            return [ordered(v) for v in obj]
        return obj

    return {name: ordered(json.loads(text)) for name, text in meta_texts(path).items()}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    # byte-wise: float8 has no ==, and NaNs compare unequal
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(loaded, expected, path=(), ordered=True):
    """Same node types, batch sizes, keys, dtypes, shapes and values (``ordered``: and
    shared_td's keys in the same order; a consolidated file does not keep the order)."""
    kind = type(expected).__name__
    assert type(loaded).__name__ == kind, (path, type(loaded), type(expected))
    assert loaded.batch_size == expected.batch_size, path
    if kind == "NonTensorData":
        assert loaded.data == expected.data and type(loaded.data) is type(expected.data), path
        return
    if kind == "NonTensorStack":
        assert loaded.tolist() == expected.tolist(), path
        return
    if kind == "LazyStackedTensorDict":
        assert loaded.stack_dim == expected.stack_dim, path
        assert len(loaded.tensordicts) == len(expected.tensordicts), path
        for i, (a, b) in enumerate(zip(loaded.tensordicts, expected.tensordicts)):
            assert_same(a, b, path + (i,), ordered)
        return
    if type(loaded).__module__.startswith("shared_td") and ordered:
        assert list(loaded.keys()) == list(expected.keys()), path  # meta.json order
    else:  # tensordict's loader puts the leaves before the sub-collections
        assert sorted(loaded.keys()) == sorted(expected.keys()), path
    for key in expected.keys():
        a, b = loaded.get(key), expected.get(key)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), path + (key,)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), path + (key,)
            assert torch.equal(bits(a), bits(b)), f"values of {path + (key,)} differ"
        else:
            assert_same(a, b, path + (key,), ordered)


def nested_data(batch):
    """Three levels of nesting, leaves of several dtypes (deterministic values)."""
    b, n = list(batch), torch.Size(batch).numel()
    return {
        "obs": torch.arange(n * 4.0).reshape(b + [4]),
        "done": (torch.arange(n) % 2).bool().reshape(b),
        "level1": {
            "reward": torch.linspace(-1, 1, n).reshape(b + [1]),
            "level2": {
                "idx": torch.arange(n).reshape(b) * 7,
                "level3": {"pix": (torch.arange(n * 4) * 37 % 256).to(torch.uint8)
                           .reshape(b + [2, 2])},
            },
        },
    }


def build(lib_name, data, batch, names=None):
    return LIBS[lib_name].TensorDict(data, batch_size=batch, names=names)


def nested_td(lib_name, batch, names=None):
    """``nested_data`` plus a non-contiguous and an expanded leaf, an empty sub-tensordict
    and a sub-tensordict with a longer batch size than its parent."""
    td = build(lib_name, nested_data(batch), batch, names=names)
    n = torch.Size(batch).numel()
    td["level1", "t"] = torch.arange(5.0 * n).reshape([5] + list(batch)).movedim(0, -1)
    td["level1", "level2", "e"] = torch.tensor([1.0, -1.0]).expand(list(batch) + [2])
    td["level1", "empty"] = LIBS[lib_name].TensorDict({}, batch_size=batch)
    wide = LIBS[lib_name].TensorDict({"w": torch.ones(list(batch) + [2, 3])},
                                     batch_size=list(batch) + [2])
    td["level1", "level2", "wide"] = wide
    return td


def set_non_tensor(lib_name, td, key, value):
    td[key] = LIBS[lib_name].NonTensorData(value, batch_size=td.batch_size)


def load(lib_name, path, **kwargs):
    return LIBS[lib_name].TensorDict.load_memmap(path, **kwargs)


def write_both(tmp_path, make, **kwargs):
    """Write ``make(lib_name)`` with both libraries; returns (shared_td's, tensordict's) paths."""
    for name in LIBS:
        make(name).memmap(tmp_path / name, **kwargs)
    return tmp_path / "shared_td", tmp_path / "tensordict"


# ----------------------------------------------------------------------------- nested
@pytest.mark.parametrize("batch", BATCH_SIZES)
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_nested_round_trip(tmp_path, writer, reader, batch):
    source = nested_td(writer, batch)
    source.memmap_(tmp_path / "td")
    loaded = load(reader, tmp_path / "td")
    assert_same(loaded, source)
    assert loaded["level1", "level2", "level3"].batch_size == torch.Size(batch)


@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_meta_json_and_files_equal_tensordict(tmp_path, batch):
    ours, theirs = write_both(tmp_path, lambda lib: nested_td(lib, batch))
    assert files(ours) == files(theirs)
    assert {"level1/level2/level3/pix.memmap", "level1/empty/meta.json",
            "level1/level2/wide/w.memmap"} <= files(ours)
    # same parsed JSON, same key order, in every node
    assert parsed_metas(ours) == parsed_metas(theirs)
    for name in files(ours) - set(meta_texts(ours)):
        assert open(ours / name, "rb").read() == open(theirs / name, "rb").read(), name


# ----------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_every_common_dtype(tmp_path, writer, reader):
    data = {str(d).split(".")[1]: (torch.arange(6) - 2).to(d).reshape(2, 3) for d in DTYPES}
    data["nested"] = {"f16": torch.tensor([[1.5, -2.0, 65504.0]] * 2, dtype=torch.float16)}
    source = build(writer, data, [2])
    source.save(tmp_path / "td")
    loaded = load(reader, tmp_path / "td")
    assert_same(loaded, source)
    meta = json.loads((tmp_path / "td" / "meta.json").read_text())
    assert {meta[str(d).split(".")[1]]["dtype"] for d in DTYPES} == {str(d) for d in DTYPES}
    for d in DTYPES:  # raw little-endian bytes, exactly numel * itemsize
        raw = (tmp_path / "td" / f"{str(d).split('.')[1]}.memmap").read_bytes()
        assert raw == bytes(bits(data[str(d).split(".")[1]]).numpy()), d


@pytest.mark.skipif(not FLOAT8, reason="this torch has no float8 dtypes")
def test_float8_shared_td_round_trip_tensordict_cannot_load(tmp_path):
    data = {str(d).split(".")[1]: torch.tensor([[0.5, 1.0], [2.0, -4.0]]).to(d) for d in FLOAT8}
    data["f32"] = torch.ones(2, 2)
    source = build("shared_td", data, [2])
    source.memmap(tmp_path / "ours")
    assert_same(load("shared_td", tmp_path / "ours"), source)
    # tensordict 0.15.3 writes float8 leaves but cannot load them: its dtype table has
    # no float8 entry, so load_memmap raises KeyError('torch.float8_...').
    with pytest.raises(KeyError, match="float8"):
        load("tensordict", tmp_path / "ours")
    # ... while shared_td loads the float8 leaves tensordict wrote.
    theirs = build("tensordict", data, [2])
    theirs.memmap(tmp_path / "theirs")
    assert_same(load("shared_td", tmp_path / "theirs"), source)
    assert files(tmp_path / "ours") == files(tmp_path / "theirs")
    assert parsed_metas(tmp_path / "ours") == parsed_metas(tmp_path / "theirs")


# ----------------------------------------------------------------------------- keys
def keys_data():
    # "" and ".." are a leaf in one node and a sub-directory in another
    leaves = {k: torch.full((2,), i, dtype=torch.int32) for i, k in enumerate(ROBUST_KEYS) if k}
    nested = {k: torch.full((2, 1), 10 + i) for i, k in enumerate(ROBUST_KEYS) if k != ".."}
    return {**leaves, "sub/dir": {**nested, "..": {"deep": torch.ones(2)}},
            "": {"x": torch.ones(2)}}


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_robust_keys(tmp_path, writer, reader):
    source = build(writer, keys_data(), [2])
    source.memmap(tmp_path / "td")
    loaded = load(reader, tmp_path / "td")
    assert_same(loaded, source)
    # nothing escaped the prefix
    assert not (tmp_path / "up.memmap").exists() and set(os.listdir(tmp_path)) == {"td"}


def test_robust_key_file_names_equal_tensordict(tmp_path):
    ours, theirs = write_both(tmp_path, lambda lib: build(lib, keys_data(), [2]))
    assert files(ours) == files(theirs)
    assert {"a%2Fb.memmap", "with%20space.memmap", "50%25.memmap", "c%3Ad.memmap",
            "%2E%2E.memmap", "%2E.memmap", "sub%2Fdir/%.memmap", "ünï☃.memmap",
            "back%5Cslash.memmap", "..%2Fup.memmap", "sub%2Fdir/%2E%2E/deep.memmap",
            "%/x.memmap"} <= files(ours)
    assert parsed_metas(ours) == parsed_metas(theirs)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
@pytest.mark.parametrize("read_robust", [True, False], ids=["read-robust", "read-legacy"])
def test_legacy_keys(tmp_path, writer, reader, read_robust):
    data = {k: torch.full((2,), i) for i, k in enumerate(SAFE_LEGACY_KEYS)}
    data["sub dir"] = {k: torch.full((2,), 10.0 + i) for i, k in enumerate(SAFE_LEGACY_KEYS)}
    source = build(writer, data, [2])
    source.memmap(tmp_path / "td", robust_key=False)
    written = files(tmp_path / "td")
    assert "with space.memmap" in written and "sub dir/50%.memmap" in written  # raw names
    assert_same(load(reader, tmp_path / "td", robust_key=read_robust), source)


def test_legacy_file_names_equal_tensordict(tmp_path):
    data = {k: torch.full((2,), i) for i, k in enumerate(SAFE_LEGACY_KEYS)}
    data["sub dir"] = {"ünï": torch.ones(2)}
    ours, theirs = write_both(tmp_path, lambda lib: build(lib, data, [2]), robust_key=False)
    assert files(ours) == files(theirs)


# ----------------------------------------------------------------------------- non-tensor
JSON_VALUES = {
    "str": "walk", "int": 3, "float": 1.5, "bool": True, "list": [1, "a", None, 2.5],
    "dict": {"k": 1, "nested": {"x": [1, 2]}}, "none": None,
}


@pytest.mark.parametrize("batch", [[], [2]], ids=["batch[]", "batch[2]"])
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_non_tensor_data_json(tmp_path, writer, reader, batch):
    source = build(writer, {"x": torch.zeros(batch + [1]), "sub": {}}, batch)
    for key, value in JSON_VALUES.items():
        set_non_tensor(writer, source, key, value)
    set_non_tensor(writer, source.get("sub"), "deep", "text")
    source.memmap(tmp_path / "td")
    assert not any(f.endswith((".pickle", ".pkl")) for f in files(tmp_path / "td"))
    loaded = load(reader, tmp_path / "td", allow_pickle=False)
    assert_same(loaded, source)
    for key, value in JSON_VALUES.items():
        assert loaded[key] == value


def test_non_tensor_nan_and_unicode(tmp_path):
    # tensordict (stdlib json) writes NaN as a bare NaN token and escapes non-ASCII;
    # shared_td reads both. shared_td writes NaN to other.pickle (NaN is not JSON) and
    # non-ASCII as UTF-8: tensordict reads both (the pickle with allow_pickle=True).
    for writer, reader in (("tensordict", "shared_td"), ("shared_td", "tensordict")):
        source = build(writer, {}, [2])
        set_non_tensor(writer, source, "nan", float("nan"))
        set_non_tensor(writer, source, "uni", "ünï☃")
        source.memmap(tmp_path / writer)
        loaded = load(reader, tmp_path / writer, allow_pickle=True)
        assert loaded["nan"] != loaded["nan"] and loaded["uni"] == "ünï☃"
    assert (tmp_path / "shared_td" / "nan" / "other.pickle").exists()
    assert "NaN" in (tmp_path / "tensordict" / "nan" / "meta.json").read_text()


def test_non_tensor_data_json_files_equal_tensordict(tmp_path):
    def make(lib):
        td = build(lib, {}, [2])
        for key, value in JSON_VALUES.items():
            set_non_tensor(lib, td, key, value)
        return td

    ours, theirs = write_both(tmp_path, make)
    assert files(ours) == files(theirs) == {"meta.json"} | {f"{k}/meta.json" for k in JSON_VALUES}
    assert meta_texts(ours) == meta_texts(theirs)  # ASCII values: byte-identical


PICKLED_VALUES = {"fraction": fractions.Fraction(1, 3), "int_keys": {1: "a", 2: "b"},
                  "complex": 1 + 2j}


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_non_tensor_data_pickle(tmp_path, writer, reader):
    source = build(writer, {}, [2])
    for key, value in PICKLED_VALUES.items():
        set_non_tensor(writer, source, key, value)
    set_non_tensor(writer, source, "json", "plain")
    source.memmap(tmp_path / "td")
    assert files(tmp_path / "td") == {"meta.json", "json/meta.json"} | {
        f"{k}/{name}" for k in PICKLED_VALUES for name in ("meta.json", "other.pickle")}
    meta = json.loads((tmp_path / "td" / "fraction" / "meta.json").read_text())
    assert "data" not in meta and meta["_is_non_tensor"] is True
    with pytest.raises(RuntimeError, match="allow_pickle=True"):
        load(reader, tmp_path / "td", allow_pickle=False)
    loaded = load(reader, tmp_path / "td", allow_pickle=True)
    assert_same(loaded, source)
    assert loaded["int_keys"] == {1: "a", 2: "b"}


def stack_of(lib_name, values):
    return LIBS[lib_name].NonTensorStack.from_list(values)


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_non_tensor_stack_json(tmp_path, writer, reader):
    source = build(writer, {"x": torch.zeros(2, 2)}, [2, 2])
    source["grid"] = stack_of(writer, [["a", "b"], ["c", "d"]])
    source["mixed"] = stack_of(writer, [[1, None], [{"k": [1]}, 2.5]])
    source.memmap(tmp_path / "td")
    assert not any(f.endswith((".pickle", ".pkl")) for f in files(tmp_path / "td"))
    loaded = load(reader, tmp_path / "td", allow_pickle=False)
    assert_same(loaded, source)
    assert loaded[1, 0]["grid"] == "c" and loaded.get("grid").batch_size == torch.Size([2, 2])


def test_non_tensor_stack_meta_text_equals_tensordict(tmp_path):
    def make(lib):
        td = build(lib, {}, [3])
        td["s"] = stack_of(lib, ["a", "b", "c"])
        td["n"] = stack_of(lib, [[0, 1], [2, 3], [4, 5]])
        return td

    ours, theirs = write_both(tmp_path, make)
    assert files(ours) == files(theirs) == {"meta.json", "s/meta.json", "n/meta.json"}
    assert meta_texts(ours) == meta_texts(theirs)
    assert (ours / "s" / "meta.json").read_text() == (
        '{"_type":"<class \'tensordict.tensorclass.NonTensorStack\'>","_format_version":1,'
        '"_class":"tensordict:NonTensorStack","stack_dim":0,"device":null,"data":["a","b","c"]}'
    )


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_non_tensor_stack_pickle(tmp_path, writer, reader):
    source = build(writer, {}, [2])
    source["s"] = stack_of(writer, [fractions.Fraction(1, 2), {3: "x"}])
    source.memmap(tmp_path / "td")
    assert files(tmp_path / "td") == {"meta.json", "s/meta.json", "s/pickle.pkl"}
    assert json.loads((tmp_path / "td" / "s" / "meta.json").read_text())["data"] == "pickle.pkl"
    with pytest.raises(RuntimeError, match="allow_pickle=True"):
        load(reader, tmp_path / "td", allow_pickle=False)
    loaded = load(reader, tmp_path / "td", allow_pickle=True)
    assert_same(loaded, source)


def test_tensordict_default_allow_pickle_warns_but_shared_td_refuses(tmp_path):
    # documents the 0.15.3 default (None: load with a FutureWarning); shared_td refuses
    source = build("shared_td", {}, [])
    set_non_tensor("shared_td", source, "f", fractions.Fraction(2, 3))
    source.memmap(tmp_path / "td")
    with pytest.warns(FutureWarning):
        assert load("tensordict", tmp_path / "td")["f"] == fractions.Fraction(2, 3)
    with pytest.raises(RuntimeError, match="allow_pickle=True"):
        load("shared_td", tmp_path / "td")


# ----------------------------------------------------------------------------- lazy stacks
def lazy_stack(lib_name, stack_dim):
    lib = LIBS[lib_name]
    cls = lib.LazyStackedTensorDict if lib_name == "tensordict" else SharedLazy
    a = lib.TensorDict({"x": torch.zeros(3), "only_a": torch.ones(3, 2)}, [3])
    b = lib.TensorDict({"x": torch.ones(3), "only_b": {"c": torch.arange(3)}}, [3])
    set_non_tensor(lib_name, b, "label", "b")
    return cls(a, b, stack_dim=stack_dim)


@pytest.mark.parametrize("stack_dim", [0, 1])
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_lazy_stack_heterogeneous(tmp_path, writer, reader, stack_dim):
    source = lazy_stack(writer, stack_dim)
    source.memmap(tmp_path / "td")
    loaded = load(reader, tmp_path / "td")
    assert_same(loaded, source)
    assert loaded.batch_size == torch.Size([2, 3] if stack_dim == 0 else [3, 2])


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_lazy_stack_inside_tensordict(tmp_path, writer, reader):
    source = build(writer, {"y": torch.zeros(3, 2)}, [3, 2])
    source["stack"] = lazy_stack(writer, 1)
    source.memmap(tmp_path / "td")
    loaded = load(reader, tmp_path / "td")
    assert_same(loaded, source)


def test_lazy_stack_files_equal_tensordict(tmp_path):
    ours, theirs = write_both(tmp_path, lambda lib: lazy_stack(lib, 1))
    assert files(ours) == files(theirs)
    assert {"meta.json", "0/meta.json", "1/only_b/c.memmap", "1/label/meta.json"} <= files(ours)
    mine = parsed_metas(ours)
    assert mine["meta.json"][-1] == ("_shared_td_members", 2)  # shared_td's member count (docs/format.md §2.2)
    mine["meta.json"] = mine["meta.json"][:-1]
    assert mine == parsed_metas(theirs)


# ----------------------------------------------------------------------------- odd leaves
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_zero_element_leaves(tmp_path, writer, reader):
    data = {"e": torch.zeros(2, 0), "e16": torch.zeros(2, 0, 3, dtype=torch.int16),
            "sub": {"eb": torch.zeros(2, 0, dtype=torch.bool)}, "x": torch.arange(2)}
    source = build(writer, data, [2])
    source.memmap(tmp_path / "td")
    assert files(tmp_path / "td") == {"meta.json", "sub/meta.json", "x.memmap"}
    loaded = load(reader, tmp_path / "td")
    assert_same(loaded, source)
    # and back again with the reader: still no file for the empty leaves
    loaded.memmap(tmp_path / "again", copy_existing=True)
    assert files(tmp_path / "again") == files(tmp_path / "td")


@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_leaf_files_longer_than_their_data(tmp_path, writer, reader):
    data = {"x": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "sub": {"bf": torch.ones(2, dtype=torch.bfloat16)}}
    source = build(writer, data, [2])
    source.memmap(tmp_path / "td")
    for name in ("x.memmap", "sub/bf.memmap"):
        with open(tmp_path / "td" / name, "ab") as handle:
            handle.write(b"\x00\n\xff" * 7)
    for lib in (reader, writer):
        assert_same(load(lib, tmp_path / "td"), source)


# ----------------------------------------------------------------------------- names
@pytest.mark.parametrize("writer,reader", DIRECTIONS)
def test_batch_dim_names(tmp_path, writer, reader):
    source = nested_td(writer, [2, 3], names=["env", None])
    source.memmap(tmp_path / "td")
    assert json.loads((tmp_path / "td" / "meta.json").read_text())["_names"] == ["env", None]
    loaded = load(reader, tmp_path / "td")
    assert loaded.names == ["env", None]
    assert_same(loaded, source)
    if writer == "tensordict":  # tensordict names every nested node alike
        assert loaded["level1", "level2"].names == ["env", None]


def test_named_meta_json_equal_tensordict(tmp_path):
    def make(lib):
        td = build(lib, {"a": torch.zeros(2, 3), "sub": {"b": torch.ones(2, 3)}}, [2, 3])
        td.names = ["env", "time"]
        td.get("sub").names = ["env", "time"]  # tensordict propagates; shared_td: per node
        return td

    ours, theirs = write_both(tmp_path, make)
    assert parsed_metas(ours) == parsed_metas(theirs)
    unnamed, _ = write_both(tmp_path / "u", lambda lib: build(lib, {"a": torch.zeros(2)}, [2]))
    assert "_names" not in json.loads((unnamed / "meta.json").read_text())


# ----------------------------------------------------------------------------- reserved keys
RESERVED = {"shape": torch.ones(2), "device": torch.zeros(2, 3), "_type": torch.arange(2)}


def test_reserved_key_names(tmp_path):
    data = {**RESERVED, "ok": torch.ones(2), "sub": {"shape": torch.full((2,), 5.0)}}
    source = build("shared_td", data, [2])
    source.memmap(tmp_path / "td")
    written = files(tmp_path / "td")
    assert {"shape.memmap", "device.memmap", "_type.memmap", "sub/shape.memmap"} <= written
    ours = load("shared_td", tmp_path / "td")  # shared_td keeps them
    assert set(ours.keys()) == set(source.keys())
    for key in ("shape", "device", "_type", ("sub", "shape")):
        assert torch.equal(ours[key], source[key]) and ours[key].dtype == source[key].dtype
    theirs = load("tensordict", tmp_path / "td")  # tensordict just lacks them
    assert list(theirs.keys()) == ["ok", "sub"] and list(theirs["sub"].keys()) == []
    assert theirs.batch_size == torch.Size([2]) and torch.equal(theirs["ok"], source["ok"])
    # tensordict's own save of such keys loses them (its node fields overwrite the
    # entries), so shared_td cannot find them either; the other keys load
    tensordict.TensorDict(data, [2]).memmap(tmp_path / "tdict")
    loaded = load("shared_td", tmp_path / "tdict")
    assert set(loaded.keys()) == {"ok", "sub"} and torch.equal(loaded["ok"], source["ok"])


def test_a_leaf_file_shorter_than_meta_json_is_grown_by_tensordict_refused_by_shared_td(tmp_path):
    # What a reader by path meets while a save is swapped: one version's meta.json, the
    # other's leaf file (the README's warning about tensordict readers during rewrites).
    prefix = tmp_path / "save"
    shared_td.TensorDict({"mk": torch.full((2,), 100)}, [2]).memmap(prefix)
    meta = json.loads((prefix / "meta.json").read_text())
    meta["mk"]["shape"], meta["shape"] = [2000], [2000]
    (prefix / "meta.json").write_text(json.dumps(meta))
    leaf = prefix / "mk.memmap"
    with pytest.raises(shared_td.FileTooShortError, match="mk.memmap"):
        shared_td.load_memmap(prefix)
    assert leaf.stat().st_size == 16  # (never written)
    tensordict.TensorDict.load_memmap(prefix)
    assert leaf.stat().st_size == 16000  # grown in place, with zeros
