"""``apply`` and ``named_apply`` of a LazyStackedTensorDict, as a mixin (LazyApplyOps):
the function runs member by member (each member's own ``named_apply``, so a TensorDict
member uses tensordict_apply.py and a nested lazy stack this module) and the results
are stacked lazily, as in tensordict 0.15.3.

tensordict's keywords are taken as it takes them on a lazy stack: ``default``,
``filter_empty``, ``call_on_nested`` and ``propagate_lock`` go to the members (a member
that ``fn`` emptied counts as None; when every member does, the result is None),
``out`` is a lazy stack whose members receive the members' results, ``batch_size``
makes the stack dense first, ``names`` names the result. Only ``is_leaf`` is refused.

This module does not import lazy.py (lazy.py imports it): new stacks are built with
``self._restack``.
"""
from __future__ import annotations

from typing import Any, Callable

from shared_td.containers.base import NO_DEFAULT
from shared_td.containers.lazy_writes import _is_lazy
from shared_td.containers.tensordict_apply import _APPLY_OPTIONS, _NOT_BUILT as _APPLY_NOT_BUILT, write_results
from shared_td.containers.unsupported_options import refuse_options
from shared_td.containers.value_kinds import is_tensor_collection
from shared_td.errors import BatchSizeMismatchError


class LazyApplyOps:
    """Mixin of LazyStackedTensorDict (it relies on ``tensordicts``, ``_stack_dim``,
    ``is_locked``, ``to_tensordict``, ``_restack`` and LazyWriteOps's ``_unbind_like``)."""

    def apply(self, fn: Callable, *others: Any, **options: Any) -> Any:
        """Apply ``fn`` to every tensor leaf of every member; the results are stacked
        lazily. The keywords are :meth:`named_apply`'s (but ``nested_keys``).

        Example:
            >>> lazy = LazyStackedTensorDict(TensorDict(a=torch.zeros(2), b=torch.ones(2), batch_size=[2]),
            ...                              TensorDict(a=torch.ones(2), batch_size=[2]))
            >>> other = LazyStackedTensorDict(TensorDict(a=torch.ones(2), batch_size=[2]),
            ...                               TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2]))
            >>> lazy.apply(lambda x, y: x + y, other, default=10).tensordicts[0]["b"].tolist()
            [11.0, 11.0]
            >>> lazy.apply(lambda x: None) is None
            True
        """
        # refused here, not by named_apply, so that the error names apply
        refuse_options(self, "apply", {k: v for k, v in options.items() if k not in _APPLY_OPTIONS},
                       known=_APPLY_NOT_BUILT)
        return self.named_apply(lambda key, *values: fn(*values), *others, **options)

    def named_apply(self, fn: Callable, *others: Any, nested_keys: bool = False,
                    batch_size: Any = None, names: Any = NO_DEFAULT, inplace: bool = False,
                    device: Any = NO_DEFAULT, default: Any = NO_DEFAULT, filter_empty: bool | None = None,
                    call_on_nested: bool = False, out: Any = None, propagate_lock: bool = False,
                    _prefix: tuple = (), _default: Any = NO_DEFAULT, _filter_empty: bool | None = None,
                    **options: Any) -> Any:
        """Like ``apply`` with the key: ``fn(key, leaf, *others_leaves)`` per member.

        The keywords are tensordict 0.15.3's (see TensorDict.named_apply): ``default``
        and ``call_on_nested`` go to each member; a member that ``fn`` emptied (with
        ``filter_empty`` None or True) is an empty member, and the result is None when
        every member is so; ``out`` must be a lazy stack: along the same stack dim its
        members get the members' results, along another one it is updated with the
        result; it is returned (tensordict returns a new stack of its members).
        ``batch_size`` makes the stack dense first (``contiguous()``) and the result
        is a TensorDict, as in tensordict. ``inplace=True`` takes none of
        ``batch_size``, ``names`` and ``device`` (a ValueError, as tensordict).

        ``_default``, ``_filter_empty``, ``_prefix``: the ``default`` and
        ``filter_empty`` of a TensorDict's apply that holds this stack, and its key
        there; an ``other`` may then be that default (the other lacked this key).

        Example:
            >>> lazy = LazyStackedTensorDict(TensorDict(a=torch.zeros(2), batch_size=[2]),
            ...                              TensorDict(a=torch.ones(2), b=torch.ones(2), batch_size=[2]))
            >>> result = lazy.named_apply(lambda key, x: x if key == "a" else None, names=["s", None])
            >>> result.names, [sorted(m.keys()) for m in result.tensordicts]
            (['s', None], [['a'], ['a']])
        """
        refuse_options(self, "named_apply", options, known=_APPLY_NOT_BUILT)
        if _default is not NO_DEFAULT:
            default = _default
        if _filter_empty is not None:
            filter_empty = _filter_empty
        # (None for names or device asks for nothing: tensordict takes it with inplace=True)
        if inplace and (batch_size is not None or names not in (NO_DEFAULT, None) or device not in (NO_DEFAULT, None)):
            raise ValueError(
                "named_apply on a lazy stack with inplace=True takes no batch_size, names or device (as "
                "tensordict 0.15.3): the members are written in place and keep theirs."
            )
        common = {"nested_keys": nested_keys, "default": default, "filter_empty": filter_empty,
                  "call_on_nested": call_on_nested}
        if inplace:  # every member's results made and checked before the first is written
            write_results(self, self.named_apply(fn, *others, _prefix=_prefix, **common))
            return self
        if batch_size is not None:
            # (contiguous, not to_tensordict: a nested tensorclass keeps its class, as tensordict)
            result = self.contiguous().named_apply(
                fn, *others, batch_size=batch_size, names=names, device=device, out=out,
                _prefix=_prefix or None, **common,
            )
            return _locked_as(self, result, propagate_lock)
        out_members = None
        if out is not None:
            if not _is_lazy(out):
                raise ValueError(
                    f"out must be a LazyStackedTensorDict in lazy_stack.apply(..., out=out) (as tensordict "
                    f"0.15.3), not a {type(out).__name__}: its members receive the members' results."
                )
            _check_out(self, out)
            if out._stack_dim != self._stack_dim:  # other slices than this stack's members
                result = self.named_apply(fn, *others, names=names, device=device, _prefix=_prefix, **common)
                if result is not None:
                    out.update(result)
                return _locked_as(self, out, propagate_lock)
            out_members = out.tensordicts
        count = len(self.tensordicts)
        # (an other that is not a tensordict is the default of an apply that holds this
        # stack, given for its whole subtree: each member gets it)
        split = [self._unbind_like(other) if is_tensor_collection(other) or default is NO_DEFAULT
                 else [other] * count for other in others]
        results = []
        for i, member in enumerate(self.tensordicts):
            results.append(member.named_apply(
                fn, *[parts[i] for parts in split], device=device,
                out=None if out_members is None else out_members[i], _prefix=_prefix, **common,
            ))
        if out is not None:
            if names is not NO_DEFAULT:  # (tensordict names the result it builds of out's members)
                out.names = names
            return _locked_as(self, out, propagate_lock)
        emptied = [_emptied(member, result, filter_empty) for member, result in zip(self.tensordicts, results)]
        if filter_empty is not False and all(emptied):
            return None  # (every member emptied by fn, or none at all: as tensordict 0.15.3)
        results = [member.empty() if result is None else result for member, result in zip(self.tensordicts, results)]
        stacked = self._restack(results, member_wise=True)
        if names is not NO_DEFAULT:
            stacked.names = names
        return _locked_as(self, stacked, propagate_lock)


def _emptied(member: Any, result: Any, filter_empty: bool | None) -> bool:
    """True when a member's result counts as None for ``filter_empty``, as a TensorDict's
    apply gives None: no entry left, and ``fn`` emptied it (it had entries) or
    ``filter_empty=True``. (Members are called with ``_prefix``, so a TensorDict member
    answers an empty tensordict rather than None; a nested lazy stack answers None.)

    A nested lazy stack's result is never emptied when it is not None: its own
    ``named_apply`` already gives None when every one of its members was emptied, and its
    keys are only those all its members share (members holding different keys counted as
    emptied and were dropped)."""
    if result is None:
        return True
    if _is_lazy(member):
        return False
    return filter_empty is not False and not list(result.keys()) and bool(filter_empty or list(member.keys()))


def _check_out(source: Any, out: Any) -> None:
    """Refuse an ``out`` that cannot take ``source``'s result, before anything is written
    into it (one with fewer members was half-written, then a bare IndexError; one with
    more was returned with a batch size that is not the result's)."""
    if out.batch_size != source.batch_size or (
            out._stack_dim == source._stack_dim and len(out.tensordicts) != len(source.tensordicts)):
        raise BatchSizeMismatchError(
            f"out has batch size {list(out.batch_size)} ({len(out.tensordicts)} members along dim "
            f"{out._stack_dim}) but the lazy stack applied has {list(source.batch_size)} "
            f"({len(source.tensordicts)} members along dim {source._stack_dim}): out receives the "
            "result, which has the stack's batch size."
        )


def _locked_as(source: Any, result: Any, propagate_lock: bool) -> Any:
    """``result``, locked when ``propagate_lock`` and ``source`` is locked."""
    if propagate_lock and result is not None and source.is_locked:
        result.lock_()
    return result
