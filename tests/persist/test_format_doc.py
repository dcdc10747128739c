"""docs/format.md stays true: its examples are real saves and it names every format name.

* Each ``<!-- meta: LIB EXAMPLE/PATH -->`` block is compared (keys in order, values) with
  the meta.json that LIB writes for the same tree today; each ``<!-- listing: LIB EXAMPLE -->``
  block with the files of that save and their sizes (pickle sizes depend on the Python
  version and are not compared).
* Every name constant of persist/format.py, every node kind of persist/nodes.py, every
  temporary file name and every staging-directory kind of persist/atomic.py must appear
  in the document: adding one without documenting it fails here.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import threading
import warnings

import pytest

from shared_td.storage.files import Directory
import torch

import shared_td
from shared_td.persist import atomic, nodes
from shared_td.persist import format as fmt

DOC_PATH = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "format.md")
with open(DOC_PATH, encoding="utf-8") as _file:
    DOC = _file.read()

_MARKED = re.compile(r"<!-- (meta|listing): (\S+) (\S+) -->\n```(\w+)\n(.*?)```", re.DOTALL)
MARKED = [match.groups() for match in _MARKED.finditer(DOC)]
JSON_BLOCKS = re.findall(r"```json\n(.*?)```", DOC, re.DOTALL)
PICKLES = (fmt.OTHER_PICKLE, fmt.STACK_PICKLE)


@shared_td.tensorclass
class Obs:
    pixels: torch.Tensor
    task: str


def _tensordict_0153():
    tensordict = pytest.importorskip("tensordict", reason="tensordict==0.15.3 (test extra) is not installed")
    if tensordict.__version__ != "0.15.3":
        pytest.skip(f"the document describes tensordict 0.15.3, not {tensordict.__version__}")
    return tensordict


# The trees of the document's examples, built with either library.
EXAMPLES = {
    "td": lambda lib: lib.TensorDict(
        {"obs": torch.arange(6.0).reshape(2, 3),
         "next": lib.TensorDict({"reward": torch.ones(2, dtype=torch.int64)}, [2]),
         "a b/c": torch.zeros(2, dtype=torch.uint8),
         "note": "hello"}, batch_size=[2]),
    "float8_names": lambda lib: lib.TensorDict(
        {"x": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}, [2], names=["env"]),
    "reserved": lambda lib: lib.TensorDict(
        {"shape": torch.zeros(1), "device": torch.ones(1), "_class": torch.ones(1),
         "_names": torch.ones(1), "empty": torch.zeros(1, 0)}, [1]),
    "lazy": lambda lib: lib.LazyStackedTensorDict(
        lib.TensorDict({"a": torch.zeros(2)}, []), lib.TensorDict({"a": torch.ones(3)}, []), stack_dim=0),
    "nts": lambda lib: lib.TensorDict({"s": lib.NonTensorStack("x", "y")}, [2]),
    "pickled": lambda lib: lib.TensorDict(
        {"p": lib.NonTensorData(1 + 2j), "ps": lib.NonTensorStack({1: "a"}, {2: "b"})}, [2]),
    "tensorclass": lambda lib: Obs(pixels=torch.zeros(2, 1), task="walk", batch_size=[2]),
}
# The example whose root is a node of each kind the writer knows.
KIND_EXAMPLES = {
    nodes.TENSORDICT: ("td", ""), nodes.LAZY: ("lazy", ""), nodes.TENSORCLASS: ("tensorclass", ""),
    nodes.NON_TENSOR_DATA: ("td", "note"), nodes.NON_TENSOR_STACK: ("nts", "s"),
}


def _library(name: str):
    return shared_td if name == "shared_td" else _tensordict_0153()


def _save(name: str, library: str, tmp_path) -> str:
    if name == "tensorclass" and library != "shared_td":
        raise AssertionError("the tensorclass example is shared_td's only")
    prefix = os.path.join(tmp_path, library, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tensordict's FutureWarnings
        EXAMPLES[name](_library(library)).memmap_(prefix)
    return prefix


def _with_class_name(document, cls):
    """The document with ``__main__.Obs`` (how the page's script named it) as ``cls``."""
    text = json.dumps(document).replace("<class '__main__.Obs'>", str(cls))
    return json.loads(text)


def test_the_document_has_its_examples():
    kinds = {(kind, library, path.split("/")[0]) for kind, library, path, _, _ in MARKED}
    for name in EXAMPLES:
        assert ("meta", "shared_td", name) in kinds, f"no meta.json shown for the example {name!r}"
    assert ("listing", "shared_td", "td") in kinds
    for block in JSON_BLOCKS:
        json.loads(block)  # every JSON block of the page parses


@pytest.mark.parametrize("library,path", [(lib, path) for kind, lib, path, _, _ in MARKED if kind == "meta"])
def test_meta_json_shown_is_what_is_written(library, path, tmp_path):
    name, _, inner = path.partition("/")
    block = next(body for kind, lib, p, _, body in MARKED if (kind, lib, p) == ("meta", library, path))
    prefix = _save(name, library, tmp_path)
    with open(os.path.join(prefix, inner), encoding="utf-8") as file:
        written = json.load(file)
    shown = _with_class_name(json.loads(block), Obs)
    # json.dumps keeps the keys in order: the order of the fields is compared too
    assert json.dumps(shown) == json.dumps(written), f"{path} as {library} writes it now: {json.dumps(written)}"


@pytest.mark.parametrize("library,name", [(lib, p) for kind, lib, p, _, _ in MARKED if kind == "listing"])
def test_listing_shown_is_what_is_written(library, name, tmp_path):
    block = next(body for kind, lib, p, _, body in MARKED if (kind, lib, p) == ("listing", library, name))
    shown = dict(re.fullmatch(r"(\S+)  \((\d+) B\)", line).groups() for line in block.strip().splitlines())
    prefix = _save(name, library, tmp_path)
    written = {}
    for directory, _, files in os.walk(prefix):
        for file in files:
            path = os.path.join(directory, file)
            written[os.path.relpath(path, prefix)] = str(os.path.getsize(path))
    assert sorted(shown) == sorted(written)
    for path, size in shown.items():
        if name == "tensorclass" and path == fmt.META:  # its _type names the test module
            size = str(int(size) + len(str(Obs)) - len("<class '__main__.Obs'>"))
        if os.path.basename(path) not in PICKLES:
            assert written[path] == size, f"{name}/{path}: {written[path]} bytes now, the page says {size}"


def test_every_node_kind_the_writer_knows_has_an_example(tmp_path):
    kinds = {value for key, value in vars(nodes).items() if key.isupper() and isinstance(value, str)}
    assert kinds == set(KIND_EXAMPLES), "a node kind was added: give it an example in docs/format.md"
    shown_types = set()
    for block in JSON_BLOCKS:
        document = json.loads(block)
        if "_type" in document:
            shown_types.add(document["_type"])
    for kind, (name, inner) in KIND_EXAMPLES.items():
        prefix = _save(name, "shared_td", tmp_path / kind)
        with open(os.path.join(prefix, inner, fmt.META), encoding="utf-8") as file:
            type_string = json.load(file)["_type"]
        if kind == nodes.TENSORCLASS:
            type_string = "<class '__main__.Obs'>"
        assert type_string in shown_types, f"no meta.json of a {kind} node in docs/format.md"
        if kind != nodes.TENSORCLASS:
            assert f"| `{type_string}` |" in DOC, f"{type_string} is missing from the table of §2"


def _constant_values(value) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (dict,)):
        return [*value, *(v for v in value.values() if isinstance(v, str))]
    if isinstance(value, (frozenset, set, tuple, list)):
        return list(value)
    raise AssertionError(f"teach this test how docs/format.md documents a {type(value).__name__}")


def test_every_name_of_format_py_is_documented():
    constants = {k: v for k, v in vars(fmt).items() if k.isupper() and not k.startswith("_")}
    assert {"META", "LEAF_SUFFIX", "OTHER_PICKLE", "STACK_PICKLE", "RESERVED_ENTRIES"} <= set(constants)
    for name, value in constants.items():
        if name == "FORMAT_VERSION":
            assert f'"_format_version": {value}' in DOC
            continue
        for text in _constant_values(value):
            assert text in DOC, f"format.{name}: {text!r} is not in docs/format.md"
    float8 = [name for name in fmt.DTYPE_BY_NAME if "float8" in name]
    assert float8, "this torch has float8 dtypes; the page documents them"


def test_every_temporary_file_name_is_documented(tmp_path):
    documented = set(re.findall(r"`([\w.]+)\.<pid>\.<tid>\.tmp`", DOC))
    written_in_place = {fmt.META}
    for kind in KIND_EXAMPLES:
        written_in_place.update(nodes.side_files(kind))
    assert written_in_place <= documented, f"undocumented temporary names of {written_in_place - documented}"
    for base in documented:
        assert fmt.temporary_writer_pid(f"{base}.4242.1399.tmp") == 4242, base
    # the real name write_temporary makes has the documented shape
    with Directory.open(str(tmp_path)) as directory:
        made = fmt.write_temporary(directory, fmt.META, b"{}")
    assert made == f"{fmt.META}.{os.getpid()}.{threading.get_ident()}.tmp"
    os.unlink(tmp_path / made)


def test_every_lock_and_staging_name_is_documented(tmp_path):
    prefix = str(tmp_path / "buf")
    assert os.path.basename(atomic.lock_path(prefix)) == ".buf.lock"
    assert "`.<name>.lock`" in DOC
    kinds = set(re.findall(r"\{_TAG\}-(\w+)-", inspect.getsource(atomic)))
    assert kinds >= {"new"}
    for kind in kinds:
        assert f"`.<name>.shared_td-{kind}-<pid>-<rand>`" in DOC, f"staging kind {kind!r} undocumented"
        rand = {"new": "0123456789ab", "old": "k2j5x_9a"}[kind]  # token_hex(6), mkdtemp's
        assert atomic.parse_leftover_name(f".buf.shared_td-{kind}-4242-{rand}") == ("buf", 4242)
    staging = atomic.Staging(prefix)
    try:
        assert re.fullmatch(rf"\.buf\.shared_td-new-{os.getpid()}-[0-9a-f]{{12}}", os.path.basename(staging.path))
    finally:
        staging.discard(RuntimeError("test"))


def test_tensordict_reads_around_shared_td_extra_fields(tmp_path):
    """§6 and §3: tensordict skips _shared_td_entries and cannot load float8."""
    tensordict = _tensordict_0153()
    reserved = _save("reserved", "shared_td", tmp_path)
    assert set(shared_td.load_memmap(reserved).keys()) == {"shape", "device", "_class", "_names", "empty"}
    assert set(tensordict.TensorDict.load_memmap(reserved).keys()) == {"empty"}
    float8 = _save("float8_names", "shared_td", tmp_path)
    assert shared_td.load_memmap(float8).names == ["env"]
    with pytest.raises(KeyError, match="float8_e4m3fn"):
        tensordict.TensorDict.load_memmap(float8)


@pytest.mark.parametrize("key", ["_class", "_format_version", "_names"])
def test_tensordict_keys_named_like_node_fields_load_in_shared_td(key, tmp_path):
    tensordict = _tensordict_0153()
    prefix = str(tmp_path / "saved")
    tensordict.TensorDict({key: torch.ones(1), "a": torch.zeros(1)}, [1]).memmap_(prefix)
    with open(os.path.join(prefix, fmt.META), encoding="utf-8") as file:
        assert "dtype" in json.load(file)[key]  # tensordict kept the key's entry there
    assert set(shared_td.load_memmap(prefix).keys()) == {key, "a"}
