"""Exceptions of shared_td.

They subclass the built-in exceptions that tensordict raises in the same situations, so
code written for tensordict (``except RuntimeError``, ``except KeyError``) keeps working,
while the type says more precisely what went wrong.
"""


class BatchSizeMismatchError(ValueError, RuntimeError):
    """A value's leading dimensions do not match the batch size of its tensordict.

    tensordict raises ``RuntimeError`` here; this is a ``ValueError`` that is also a
    ``RuntimeError``, so both kinds of handler catch it.
    """


class LockedTensorDictError(RuntimeError):
    """An entry was added, removed or replaced in a locked tensordict."""


class KeyTypeError(TypeError, KeyError):
    """A key is not a ``str`` or a tuple of ``str`` (tensordict raises ``KeyError``)."""

    __str__ = BaseException.__str__


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


def _rebuild_format_error(path: str, reason: str, field: str | None) -> FormatError:
    return FormatError(path, reason, field=field)


class OwnerLostError(ConnectionError):
    """The node that owns a name published across machines stopped answering (no
    heartbeat in the cluster store): ``pull``, ``push`` and ``sync`` of that name fail
    with it, while the replicas stay readable with their last version."""
