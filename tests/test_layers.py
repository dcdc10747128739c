"""The layers of shared_td import only the layers below them, also inside functions.

storage/, keys.py, errors.py, platform.py, tensorclass_protocol.py, nontensor_values.py  <-  memmap_tensor/
<-  persist/  <-  containers/  <-  coordinator/  <-  cli/, demo/, bench/ (and the
package's __init__).

The manager process (coordinator/server*.py, and the modules it loads by path) imports
no container module at all: the layouts reach it as plain data. Modules stay under
:data:`MAX_LINES` lines (DESIGN.md).
"""
from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared_td")

LAYERS = {
    "storage": 0, "keys": 0, "errors": 0, "platform": 0, "platform_locks": 0, "memory_check": 0, "finalizers": 0,
    "tensorclass_protocol": 0, "nontensor_values": 0, "thread_pool": 0,
    "memmap_tensor": 1,
    "persist": 2,
    "containers": 3,
    "coordinator": 4,
    "cli": 5, "demo": 5, "bench": 5, "__main__": 5,
}
TOP = 6  # shared_td/__init__.py: the public face, above every layer
MAX_LINES = 600  # DESIGN.md: "Keep modules under ~600 lines"

# Calls that import the module named by their first argument: the standard ones, and the
# loaders that load a torch-free module of the package by its path (server.py,
# platform.py); _load_sibling takes the name below the package.
_IMPORTING_CALLS = {"import_module": "", "__import__": "", "_load_torch_free": "", "_load_sibling": "shared_td."}


def layer_of(module: str) -> int:
    """``shared_td.persist.loader`` -> 2; the package itself, or a public name imported
    from it (``shared_td.TensorDict``) -> TOP."""
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
    parts = relative.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _called_name(node: ast.Call) -> str | None:
    """``import_module`` for ``importlib.import_module(...)`` or ``import_module(...)``."""
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def imported_modules(path: str, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every shared_td import in the file, at any depth: import
    statements, and the calls of :data:`_IMPORTING_CALLS` with a literal name."""
    module = module_name(path)
    is_package = path.endswith("__init__.py")
    if source is None:
        with open(path, encoding="utf-8") as file:
            source = file.read()
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from shared_td import persist` imports the sub-package persist
            names = [f"{target}.{alias.name}" for alias in node.names] if target == "shared_td" else [target]
            found += [(node.lineno, name) for name in names]
        elif isinstance(node, ast.Call) and _called_name(node) in _IMPORTING_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, _IMPORTING_CALLS[_called_name(node)] + first.value))
    return [(line, name) for line, name in found if name == "shared_td" or name.startswith("shared_td.")]


def python_files() -> list[str]:
    return sorted(os.path.join(folder, name) for folder, _, names in os.walk(PACKAGE)
                  for name in names if name.endswith(".py"))


def upward_imports() -> list[str]:
    edges = []
    for path in python_files():
        module = module_name(path)
        if module == "shared_td":
            continue
        here = layer_of(module)
        for line, target in imported_modules(path):
            target_layer = layer_of(target)
            # the faces (cli, demo, bench) may use the public package itself
            if target_layer > here and not (here == 5 and target_layer == TOP):
                edges.append(f"{os.path.relpath(path, PACKAGE)}:{line}: {module} imports {target}")
    return edges


def test_every_module_belongs_to_a_layer():
    unknown = {module_name(p).split(".")[1] for p in python_files() if module_name(p) != "shared_td"}
    assert unknown <= set(LAYERS), f"give these a layer: {sorted(unknown - set(LAYERS))}"


def test_no_layer_imports_a_layer_above_it():
    assert upward_imports() == []


def _path_of(module: str) -> str | None:
    """The file of the package's module ``module``, None if there is none."""
    base = os.path.join(os.path.dirname(PACKAGE), *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def manager_modules() -> dict[str, str]:
    """module -> file of what the manager process runs: coordinator/server*.py and the
    modules they load by path (the literal targets of _load_torch_free and _load_sibling),
    and what those load in turn."""
    files = {module_name(p): p for p in python_files() if os.path.basename(p).startswith("server")
             and os.path.basename(os.path.dirname(p)) == "coordinator"}
    todo = list(files.values())
    while todo:
        with open(todo.pop(), encoding="utf-8") as file:
            tree = ast.parse(file.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called_name(node) in ("_load_torch_free", "_load_sibling"):
                first = node.args[0] if node.args else None
                assert isinstance(first, ast.Constant), f"a loader call without a literal name (line {node.lineno})"
                module = _IMPORTING_CALLS[_called_name(node)] + first.value
                if module not in files:
                    files[module] = _path_of(module)
                    assert files[module], f"the manager loads {module}, which has no file"
                    todo.append(files[module])
    return files


def manager_imports(files: dict[str, str]) -> list[str]:
    """The imports of shared_td, at any depth, of the manager's modules that are not
    themselves loaded by path: each would import the package (torch, the containers)."""
    return [f"{os.path.relpath(path, PACKAGE)}:{line}: {target}" for path in files.values()
            for line, target in imported_modules(path) if target not in files]


def test_the_manager_process_imports_no_container():
    files = manager_modules()
    assert {"shared_td.coordinator.server", "shared_td.coordinator.registry", "shared_td.platform"} <= set(files)
    assert manager_imports(files) == []


def test_no_module_is_over_the_size_limit():
    sizes = {}
    for path in python_files():
        with open(path, encoding="utf-8") as file:
            sizes[os.path.relpath(path, PACKAGE)] = sum(1 for _ in file)
    too_big = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert too_big == {}, f"over {MAX_LINES} lines (split them, see DESIGN.md): {too_big}"


@pytest.mark.parametrize("source, expected", [
    ("from shared_td.containers import base\n", ["shared_td.containers"]),
    ("def f():\n    from shared_td import persist\n", ["shared_td.persist"]),
    ("def f():\n    from ..coordinator import client\n", ["shared_td.coordinator"]),
    ("import shared_td.cli\n", ["shared_td.cli"]),
    ("def f():\n    return importlib.import_module('shared_td.coordinator.client')\n", ["shared_td.coordinator.client"]),
    ("def f():\n    return __import__('shared_td.containers')\n", ["shared_td.containers"]),
    ("m = _load_torch_free('shared_td.coordinator.registry', 'coordinator', 'registry.py')\n",
     ["shared_td.coordinator.registry"]),
    ("m = _load_sibling('memory_check')\n", ["shared_td.memory_check"]),
    ("m = importlib.import_module(name)\n", []),  # not a literal: nothing to check
])
def test_imports_inside_functions_are_found(source, expected):
    inside = os.path.join(PACKAGE, "storage", "probe.py")  # a module of storage/
    assert [name for _, name in imported_modules(inside, source)] == expected
