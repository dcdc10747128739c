"""``shared-td inspect PREFIX``: the tree of a saved tensordict, from its meta.json files.

Nothing is mapped or unpickled: a pickled non-tensor value is shown as
``<pickled, N bytes>``. Works on directories written by shared_td and by tensordict 0.15.3.
"""
from __future__ import annotations

import argparse
import dataclasses

from shared_td.cli.common import human_bytes, plural, print_json, print_lines
from shared_td.persist.survey import NODE, TENSOR, Entry, Survey, survey

EPILOG = """examples:
  shared-td inspect /data/buffer          the tree, with sizes and totals
  shared-td inspect --json /data/buffer   the same as JSON (keys: prefix, tree, totals, problems)

Keys are shown as written by the user (file names are percent-encoded on disk); a key
that is empty or has spaces or control characters is shown quoted. Non-tensor values
are cut to 60 characters. Exit code 1 if PREFIX holds no saved tensordict.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prefix", metavar="PREFIX", help="the directory or .tdz archive of a saved tensordict")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a tree")


def run(args: argparse.Namespace) -> int:
    found = survey(args.prefix)
    if args.json:
        print_json(as_json(found))
    else:
        print_lines(tree_lines(found))
    return 0


def as_json(found: Survey) -> dict:
    """The survey as plain JSON types (entries nest under ``children``)."""
    return {
        "prefix": found.prefix,
        "tree": _entry_json(found.root),
        "totals": found.totals(),
        "problems": [dataclasses.asdict(p) for p in found.problems],
    }


def _entry_json(entry: Entry) -> dict:
    document = {
        "key": entry.key, "kind": entry.kind, "class": entry.class_name, "path": entry.path,
        "batch_size": entry.batch_size, "dtype": entry.dtype, "shape": entry.shape,
        "bytes": entry.nbytes, "size_on_disk": entry.size_on_disk, "value": entry.value,
    }
    if entry.kind == NODE:
        document["children"] = [_entry_json(child) for child in entry.children]
    return document


def tree_lines(found: Survey) -> list[str]:
    """The text output: a header, one line per entry, totals, a hint if broken."""
    root = found.root
    header = f"{found.prefix}: {root.class_name}"
    if root.batch_size is not None:
        header += f", batch size {root.batch_size}"
    rows = list(_rows(root.children, ""))
    width = max((len(label) for label, _ in rows), default=0)
    lines = [header] + [f"{label:<{width}}  {text}".rstrip() for label, text in rows]
    totals = found.totals()
    lines.append(
        f"{plural(totals['leaves'], 'leaf')}, {human_bytes(totals['bytes'])} of tensor data "
        f"({human_bytes(totals['bytes_on_disk'])} in leaf files), "
        f"{plural(totals['non_tensor_values'], 'non-tensor value')}"
    )
    if found.problems:
        lines.append(
            f"{plural(len(found.errors), 'error')}, {plural(len(found.warnings), 'warning')}: "
            f"run `shared-td verify {found.prefix}` for the list"
        )
    return lines


def _rows(entries: list[Entry], indent: str):
    """(label, description) per entry, with tree branches in the label."""
    for position, entry in enumerate(entries):
        last = position == len(entries) - 1
        yield indent + ("└── " if last else "├── ") + _shown_key(entry.key), _describe(entry)
        if entry.kind == NODE:
            yield from _rows(entry.children, indent + ("    " if last else "│   "))


def _describe(entry: Entry) -> str:
    if entry.kind == TENSOR:
        dtype = str(entry.dtype).removeprefix("torch.")
        size = "missing" if entry.size_on_disk is None else human_bytes(entry.size_on_disk)
        if entry.nbytes is not None and entry.size_on_disk is not None and entry.size_on_disk < entry.nbytes:
            size += f" (needs {human_bytes(entry.nbytes)})"
        if entry.class_name == "nested":  # its shape is that of the sizes: [tensors, dims]
            return f"{dtype:<9} {'nested':<14} {size}  ({entry.shape[0] if entry.shape else 0} tensors)"
        return f"{dtype:<9} {_shape(entry.shape):<14} {size}"
    if entry.kind == NODE:
        batch = "" if entry.batch_size is None else f"  batch size {entry.batch_size}"
        return f"{entry.class_name}{batch}"
    return f"{entry.class_name}  {entry.value}"


def _shape(shape) -> str:
    if isinstance(shape, list):
        return "[" + ", ".join(str(n) for n in shape) + "]"
    return repr(shape)


def _shown_key(key: str) -> str:
    plain = key and key.isprintable() and " " not in key
    return key if plain else repr(key)
