"""The layers of shared_td import only the layers below them, also inside functions.

storage/, keys.py, errors.py, platform.py, tensorclass_protocol.py  <-  memmap_tensor/
<-  persist/  <-  containers/  <-  coordinator/  <-  cli/, demo/, bench/ (and the
package's __init__).

The manager process (coordinator/server*.py) imports no container module at all: the
layouts reach it as plain data.
"""
from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shared_td")

LAYERS = {
    "storage": 0, "keys": 0, "errors": 0, "platform": 0, "memory_check": 0, "tensorclass_protocol": 0,
    "memmap_tensor": 1,
    "persist": 2,
    "containers": 3,
    "coordinator": 4,
    "cli": 5, "demo": 5, "bench": 5, "__main__": 5,
}
TOP = 6  # shared_td/__init__.py: the public face, above every layer


def layer_of(module: str) -> int:
    """``shared_td.persist.loader`` -> 2; the package itself, or a public name imported
    from it (``shared_td.TensorDict``) -> TOP."""
    parts = module.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def module_name(path: str) -> str:
    relative = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")]
    parts = relative.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: str, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every shared_td import in the file, at any depth."""
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


def test_the_manager_process_imports_no_container():
    server_files = [p for p in python_files() if os.path.basename(p).startswith("server")
                    and os.path.basename(os.path.dirname(p)) == "coordinator"]
    assert server_files
    containers = [f"{os.path.basename(p)}:{line}: {target}" for p in server_files
                  for line, target in imported_modules(p)
                  if target.startswith(("shared_td.containers", "shared_td.persist")) or target == "shared_td"]
    assert containers == []


@pytest.mark.parametrize("source, expected", [
    ("from shared_td.containers import base\n", ["shared_td.containers"]),
    ("def f():\n    from shared_td import persist\n", ["shared_td.persist"]),
    ("def f():\n    from ..coordinator import client\n", ["shared_td.coordinator"]),
    ("import shared_td.cli\n", ["shared_td.cli"]),
])
def test_imports_inside_functions_are_found(source, expected):
    inside = os.path.join(PACKAGE, "storage", "probe.py")  # a module of storage/
    assert [name for _, name in imported_modules(inside, source)] == expected
