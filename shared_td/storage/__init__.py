"""Where the bytes of memory-mapped tensors live.

Two kinds of backing, one module each:

* :mod:`shared_td.storage.files` -- regular files: create/reserve them, write bytes with
  ``pwrite``, map a whole file once (:class:`~shared_td.storage.files.FileBacking`).
* :mod:`shared_td.storage.anonymous` -- anonymous shared memory: a ``memfd`` segment
  (:class:`~shared_td.storage.anonymous.Segment`) that never appears in ``/dev/shm``.

Both expose the same small surface that :class:`shared_td.MemoryMappedTensor` relies on:
``storage`` (one ``torch.UntypedStorage`` of uint8 over all the bytes), ``nbytes``, and a
``__reduce__`` that pickles a *reference* (a path, or a pid/fd/inode triple), never data;
:mod:`shared_td.storage.sending` sends plain tensors over either kind the same way.
"""

# registers how ForkingPicklers send plain tensors over either kind: by reference
from shared_td.storage import sending  # noqa: F401,E402
