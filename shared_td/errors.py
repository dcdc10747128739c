"""Exceptions of shared_td: every exception class the library raises is defined here
(torch-free, importing only the two AuthenticationError bases below) and exported from
``shared_td``.

They subclass the built-in exceptions that tensordict raises in the same situations, so
code written for tensordict (``except RuntimeError``, ``except KeyError``) keeps working,
while the type says more precisely what went wrong.

(The ``shared-td`` command's own exit signals, ``UsageError`` and ``CommandError`` in
:mod:`shared_td.cli.common`, never leave its ``main`` and are not library errors.)
"""
import multiprocessing

from multiprocess import context as _dill_context


class BatchDimError(IndexError, RuntimeError):
    """A batch dim out of range. An IndexError as torch raises for a tensor; also a
    RuntimeError, the class tensordict raises for ``unsqueeze`` (so code written for
    either library catches it)."""


class TransposeDimError(BatchDimError, ValueError):
    """A ``transpose`` or ``permute`` dim outside the batch dims: a BatchDimError (the
    IndexError torch raises) and the ValueError tensordict 0.15.3 raises."""


class BatchSizeMismatchError(ValueError, RuntimeError):
    """A value's leading dimensions do not match the batch size of its tensordict.

    tensordict raises ``RuntimeError`` here; this is a ``ValueError`` that is also a
    ``RuntimeError``, so both kinds of handler catch it.
    """


class LockedTensorDictError(RuntimeError):
    """An entry was added, removed or replaced in a locked tensordict."""


class ReadOnlyError(RuntimeError):
    """A write into a tensor mapped from a file that this process may not write (a
    read-only file system, the file's mode or an immutable file).

    Such a tensor maps its file privately (copy-on-write), so a write would stay in this
    process and be lost without a word; it is refused instead. A ``RuntimeError``, as
    torch and tensordict raise for writes they refuse.
    """


class KeyTypeError(TypeError, KeyError):
    """A key is not a ``str`` or a tuple of ``str`` (tensordict raises ``KeyError``)."""

    __str__ = BaseException.__str__


class IndexTypeError(TypeError, IndexError):
    """An index of a batch dimension is not an int, a slice, None, Ellipsis or a bool or
    integer tensor, list or array (a float, a string, an object). torch and tensordict
    raise ``IndexError``; this is a ``TypeError`` that is also an ``IndexError``."""


class KeyThroughLeafError(KeyError, ValueError):
    """A nested key runs through an entry that is not a tensordict (``td["a", "b"]``
    where ``"a"`` holds a tensor). tensordict raises ``ValueError``; this is also the
    ``KeyError`` of any other missing key. ``get(key, default)`` returns the default
    (``get(key)`` of a key missing otherwise gives None, as tensordict's)."""

    __str__ = BaseException.__str__


class StateDictKeysError(RuntimeError, KeyError):
    """``load_state_dict(strict=True)`` of a state dict whose keys are not the tree's.
    tensordict 0.15.3 raises ``RuntimeError`` for a tensordict and ``KeyError`` for a
    tensorclass; this is both."""

    __str__ = BaseException.__str__


class NotASaveError(NotADirectoryError, ValueError):
    """A path given to load a save names a file that is neither a saved tensordict
    directory nor an archive (or a FIFO, socket or device). tensordict raises
    ``ValueError``; this is also the ``NotADirectoryError`` the path calls for."""


class UnstorableValueError(TypeError, RuntimeError):
    """A non-tensor value of a type the chosen format cannot hold (a value that is not
    JSON, written by ``consolidate(filename=...)``). tensordict raises ``RuntimeError``
    here; this is a ``TypeError`` that is also a ``RuntimeError``."""


class InPlaceKindError(TypeError, ValueError, RuntimeError):
    """A value of another kind written in place into an entry (``set(..., inplace=True)``,
    ``set_``, ``update_``): a non-tensor value into a tensor entry, a tensor into a
    non-tensor one, a leaf into a nested tensordict. tensordict 0.15.3 raises a
    ``RuntimeError`` or its ``_InplaceWriteError`` (a ``ValueError`` and a
    ``RuntimeError``) there; this ``TypeError`` is all three."""


class InPlaceWriteError(ValueError, RuntimeError):
    """An entry that cannot be written in place as a whole (``set_``, ``update_``,
    ``set(..., inplace=True)``, ``apply_``): an expanded tensor (``expand()``), several of
    whose elements are one memory location, which torch refuses to write. tensordict
    0.15.3 raises its ``_InplaceWriteError`` (a ``ValueError`` and a ``RuntimeError``)
    there, after writing the entries before it; this is both, raised before any write."""


class FormatError(ValueError, RuntimeError):
    """A saved directory does not hold what its meta.json says (or is not one at all).

    ``path`` is the file at fault (a ``meta.json``, a leaf file), ``field`` the field of
    that meta.json (None when the whole file is wrong) and ``reason`` what is wrong with
    it. A ``RuntimeError``, as tensordict raises when a load fails, and a ``ValueError``
    (the bad value is in the file).

    Example:
        >>> str(FormatError("/d/meta.json", "[-2] is not a list of sizes", field="shape"))
        "/d/meta.json: field 'shape': [-2] is not a list of sizes"
    """

    def __init__(self, path: str, reason: str, *, field: str | None = None):
        self.path, self.reason, self.field = path, reason, field
        super().__init__(f"{path}: {self.detail}")

    @property
    def detail(self) -> str:
        """The message without the path: what ``shared-td verify`` prints beside it."""
        return self.reason if self.field is None else f"field {self.field!r}: {self.reason}"

    def __reduce__(self):
        return _rebuild_format_error, (self.path, self.reason, self.field)


class FileTooShortError(ValueError, RuntimeError):
    """A file holds fewer bytes than the tensor mapped over it needs.

    A ``ValueError`` that is also a ``RuntimeError`` so handlers of either catch it.
    """


class StorageFullError(OSError):
    """Space for new tensor bytes could not be reserved (disk, tmpfs or memory is full)."""


class FileReplacedError(FileNotFoundError):
    """A pickled memory-mapped tensor names a file that was replaced since (a new save,
    consolidate or atomic rewrite renamed another file over its path): the receiver
    cannot map the sender's file, and mapping the new one would read other bytes."""


class MappingError(OSError, RuntimeError):
    """A file or anonymous segment could not be memory-mapped: a limit of this process
    (``errno`` ENOMEM: ``RLIMIT_AS``, ``vm.max_map_count``, the memory commit) or no file
    descriptor left to open it (EMFILE, ENFILE); the message names the file or segment,
    its size and the limits. Nothing is left open. An ``OSError``, and the
    ``RuntimeError`` torch and tensordict raise there ("unable to mmap ...")."""


class SaveChangedError(RuntimeError):
    """A memory-mapped tensordict would rewrite the ``meta.json`` of its save
    (``make_memmap``), but that file no longer describes it: another process changed
    the save since this tensordict was loaded or written (added an entry, rewrote it
    with ``atomic=True``). Nothing was written; reload the save (``load_memmap``) and
    try again. A ``RuntimeError``."""


class SplitSizeError(ValueError, RuntimeError):
    """``split`` sizes that do not add up to the dim. A RuntimeError as tensordict (and
    torch.split) raise; also the ValueError this package raised before."""


class WorkerDiedError(RuntimeError):
    """A worker process of ``map``/``map_iter`` ended (killed, out of memory) while it
    computed a chunk; the message names the chunk."""


class WorkerTraceback(Exception):
    """The traceback of an error raised in a worker process of ``map``/``map_iter``, as
    text: the ``__cause__`` of that error raised again in the parent."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\nin the worker process:\n" + self.text


class SegmentUnavailableError(RuntimeError):
    """A pickled segment can no longer be attached: its sender exited or released it."""


class AtomicWriteError(RuntimeError):
    """An atomic rewrite (``atomic=True``) refused to start because of what the prefix
    holds: a non-empty directory with ``existsok=False``, or a directory that is not a
    saved tensordict. Nothing was written or touched. A ``RuntimeError``, as before."""


class CoordinatorAuthenticationError(ConnectionError, _dill_context.AuthenticationError,
                                     multiprocessing.AuthenticationError):
    """The coordinator refused the authkey of this process (or answered with another).

    A ConnectionError (the call did not reach the registry), and the
    ``AuthenticationError`` of both ``multiprocess`` and ``multiprocessing``: what the
    handshake raised before, so that code catching those still catches it."""


class CoordinatorTimeoutError(ConnectionError, TimeoutError):
    """A coordinator did not answer within the caller's timeout: its manager process is
    stopped (SIGSTOP, a debugger) or stalled. Both a ConnectionError (the call failed to
    reach the coordinator) and a TimeoutError (it may answer again later)."""


def _rebuild_format_error(path: str, reason: str, field: str | None) -> FormatError:
    return FormatError(path, reason, field=field)


class ClusterAuthError(PermissionError):
    """A value in the cluster store is not signed with this node's cluster authkey."""


class TransferFailed(RuntimeError):
    """A gloo transfer between two nodes failed, or did not end before its deadline."""


class TransferRefused(RuntimeError):
    """A peer node refused a cluster transfer (a name or generation it does not hold);
    ``current``: the generation of the name it owns now, when its signed answer says,
    else None (a push or pull then tells "published again" from it)."""

    def __init__(self, message: str, current: int | None = None):
        super().__init__(message)
        self.current = current if isinstance(current, int) else None


class StalePair(TransferFailed):
    """A cluster request named a generation of a node pair's gloo group that the other
    node already left (it rebuilt the group after a failure): nothing was transferred,
    and the call may be retried at once (a ``pull`` retries by itself)."""


class OwnerLostError(ConnectionError):
    """The node that owns a name published across machines stopped answering (no
    heartbeat in the cluster store): ``pull``, ``push`` and ``sync`` of that name fail
    with it, while the replicas stay readable with their last version."""


class NodeTakenOverError(ConnectionError):
    """This process no longer runs its node of a cluster: it was stopped (SIGSTOP, a
    debugger, a frozen VM) until its heartbeat stood still long enough for another process
    started with the same node number to take that number over. Every cluster call of
    this process fails with it; its replicas stay readable. Shut its Coordinator down."""


class DemoNodeStoppedError(RuntimeError):
    """``python -m shared_td demo --nodes 2``: the other node aborted the run; it failed,
    or (``interrupted``) its user pressed Ctrl-C, and this node stopped its processes."""

    def __init__(self, other: str, what: str, interrupted: bool):
        self.other, self.what, self.interrupted = other, what, interrupted
        super().__init__(f"{other} {'was interrupted' if interrupted else 'failed'} {what}")

    def __reduce__(self):  # (its arguments are not its message: pickled as made)
        return type(self), (self.other, self.what, self.interrupted)


class NameClashError(ValueError, RuntimeError):
    """A batch dim name used twice once a parent's names reach a nested tensordict: the
    ValueError tensordict 0.15.3 raises, and the RuntimeError shared_td raised before."""


class ArgumentGivenTwiceError(TypeError, ValueError):
    """A tensorclass field given both by position and by keyword: the TypeError Python
    raises for a function, and the ValueError tensordict raises."""
