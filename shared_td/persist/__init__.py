"""Persistence: memmap_, memmap, memmap_like and save write trees of tensors to files or
anonymous shared memory; load_memmap reads them back (tensordict 0.15.3's format)."""
