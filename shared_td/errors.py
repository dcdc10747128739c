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
