"""``shared-td inspect PREFIX``: the tree of a saved tensordict, from its meta.json files.

Nothing is mapped or unpickled: a pickled non-tensor value is shown as
``<pickled, N bytes>``. Works on directories written by shared_td and by tensordict 0.15.3.
"""
from __future__ import annotations

import argparse
import dataclasses

from shared_td.cli.common import human_bytes, plural, print_json, shown
from shared_td.cli.survey_report import survey_for_report
from shared_td.persist.survey import NODE, TENSOR, Entry, Survey

EPILOG = """examples:
  shared-td inspect /data/buffer          the tree, with sizes and totals
  shared-td inspect --json /data/buffer   the same as JSON (keys: prefix, tree, totals, problems)

Keys are shown as written by the user (file names are percent-encoded on disk); a key
that is empty or has spaces, quotes, backslashes or control characters is shown quoted
and escaped as a Python literal; paths are shown with control characters and
backslashes escaped (a backslash is shown doubled). Non-tensor values
are cut to 60 characters. Exit code 1 if PREFIX holds no saved tensordict; --json then
still prints the document: tree null, totals 0 and the reason as its one problem.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prefix", metavar="PREFIX", help="the directory or .tdz archive of a saved tensordict")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a tree")


def run(args: argparse.Namespace) -> int:
    # a PATH refused whole: one line on stderr, or with --json an empty tree and its one
    # problem; exit code 1 either way
    found, refused = survey_for_report(args.prefix, as_json=args.json)
    if args.json:
        print_json(as_json(found))
    else:
        print("\n".join(tree_lines(found)))
    return 1 if refused else 0


def as_json(found: Survey) -> dict:
    """The survey as plain JSON types (entries nest under ``children``)."""
    return {
        "prefix": found.prefix,
        # null for a PATH refused whole (survey_report.refused): no node was read
        "tree": _entry_json(found.root) if found.root.kind == NODE else None,
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
    """The text output: a header, one line per entry, totals, a hint if broken.

    Each name and class name in it is escaped here, once (:func:`shown`; a key by
    :func:`_shown_key`, a value is its repr already): the lines are printed as they are.
    """
    root = found.root
    header = f"{shown(found.prefix)}: {shown(root.class_name)}"
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
            f"run `shared-td verify {shown(found.prefix)}` for the list"
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
            return f"{shown(dtype):<9} {'nested':<14} {size}  ({entry.shape[0] if entry.shape else 0} tensors)"
        return f"{shown(dtype):<9} {shown(_shape(entry.shape)):<14} {size}"
    if entry.kind == NODE:
        batch = "" if entry.batch_size is None else f"  batch size {shown(str(entry.batch_size))}"
        return f"{shown(entry.class_name)}{batch}"
    # the value is a repr (NodeView.shown) or "<pickled, N bytes>": escaped already
    return f"{shown(entry.class_name)}  {_shown_value(entry.value)}"


def _shape(shape) -> str:
    if isinstance(shape, list):
        return "[" + ", ".join(str(n) for n in shape) + "]"
    return repr(shape)


def _shown_key(key: str) -> str:
    """A key as it is, or quoted and escaped as a Python literal when it is empty or
    holds a space, a quote, a backslash or a non-printable character (so ``k\\ney``,
    a backslash and an ``n``, is shown ``'k\\\\ney'`` and never reads as a newline)."""
    plain = key and key.isprintable() and not any(c in key for c in " '\"\\")
    return key if plain else repr(key)


def _shown_value(value) -> str:
    """A non-tensor value's text: a repr, so its characters are escaped already; any
    other text (not made by NodeView.shown) is escaped here."""
    text = str(value)
    return text if text.isprintable() else shown(text)
