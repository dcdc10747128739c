"""Persistence: memmap_, memmap, memmap_like and save write trees of tensors to files or
anonymous shared memory; load_memmap reads them back (tensordict 0.15.3's format).

One engine for every container class, in files and plain data:

* format.py: every name on disk and the rules of the format; node_meta.py: the metadata
  model (frozen NodeMeta, LeafMeta, ChildMeta): ``NodeMeta.from_json`` checks a
  meta.json, ``to_json`` writes one;
* nodes.py: the node-kind registry. A container class reaches the engine only through
  the NodeKind it registers (type string, entries and children, metadata and side
  files, rebuild, adopt, inspect; see that module). The containers package registers
  them (containers/node_kinds.py); this package imports no container module;
* planner.py (plan) and writer.py (write, commit), atomic.py (a sibling directory swapped in under a
  lock), loader.py (read, map, rebuild) and survey.py (inspect and verify, from the
  metadata only) dispatch through the kinds;
* api.py and functions.py: the memmap family as functions (the container methods of
  the same names, containers/memmap_methods.py, call them).
"""
