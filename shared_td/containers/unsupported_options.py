"""The TypeError of a tensordict 0.15.3 keyword (or method) that shared_td does not
build: it names the public method and the option, never one of our mixin classes (whose
names Python's own "got an unexpected keyword argument" error would show).
"""
from __future__ import annotations

from typing import Any

__all__ = ["refuse_options"]


def refuse_options(owner: Any, method: str, options: dict, known: tuple = ()) -> None:
    """Raise a TypeError for the first of ``options`` (keywords a method took in
    ``**kwargs``), if any: ``known`` ones are tensordict 0.15.3's and said to be not
    supported here; any other is an unexpected keyword, as Python says it.

    Example:
        >>> refuse_options(TensorDict(), "apply", {"is_leaf": None}, known=("is_leaf",))
        Traceback (most recent call last):
        ...
        TypeError: TensorDict.apply(is_leaf=...): tensordict 0.15.3's option is_leaf is not supported by shared_td (see the README's "Differences from tensordict 0.15.3").
    """
    if not options:
        return
    name = next(iter(options))
    call = f"{type(owner).__name__}.{method}"
    if name in known:
        raise TypeError(f"{call}({name}=...): tensordict 0.15.3's option {name} is not supported by "
                        "shared_td (see the README's \"Differences from tensordict 0.15.3\").")
    raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")


def unsupported_torch_function(func: Any, cls: type) -> TypeError:
    """The TypeError of a torch function that tensordict 0.15.3 runs on tensordicts and
    shared_td does not (``torch.where``, ``torch.gather``...): torch's own error would be
    "Multiple dispatch failed ... returned NotImplemented", which names neither.

    Example:
        >>> print(unsupported_torch_function(torch.where, TensorDict))
        torch.where(...) of a TensorDict is not supported by shared_td (tensordict 0.15.3 has it): apply it leaf by leaf, e.g. td.apply(lambda x: torch.where(...)).
    """
    import torch

    name = getattr(func, "__name__", None) or repr(func)
    if getattr(torch, name, None) is func:
        name = f"torch.{name}"
    elif getattr(torch.Tensor, name, None) is func:
        name = f"Tensor.{name}"
    # (only tensordict's own torch functions are said to be there: torch.eq, numel, isclose...
    # are in neither library)
    there = " (tensordict 0.15.3 has it)" if name.split(".")[-1] in _TENSORDICT_TORCH_FUNCTIONS else ""
    return TypeError(f"{name}(...) of a {cls.__name__} is not supported by shared_td{there}: apply it "
                     f"leaf by leaf, e.g. td.apply(lambda x: {name}(...)).")


# the torch functions that tensordict 0.15.3 runs on a TensorDict (its pointwise maths,
# reductions and shape functions), by name
_TENSORDICT_TORCH_FUNCTIONS = frozenset("""
abs abs_ acos acos_ add addcdiv addcmul asin asin_ atan atan_ atleast_1d atleast_2d atleast_3d
bitwise_and broadcast_to cat ceil ceil_ chunk clamp clamp_max clamp_max_ clamp_min clamp_min_ clone
cos cos_ cosh cosh_ div empty_like erf erf_ erfc erfc_ exp exp_ expm1 expm1_ flatten flip fliplr
flipud floor floor_ frac frac_ full_like gather grad isfinite isnan isneginf isposinf isreal lerp
lgamma log log10 log10_ log1p log1p_ log2 log2_ log_ logical_and masked_select maximum mean minimum
moveaxis movedim mul narrow neg neg_ l1_loss mse_loss smooth_l1_loss ones_like permute pow rand_like
randn_like reciprocal reciprocal_ repeat_interleave reshape roll rot90 round round_ rsub sigmoid
sigmoid_ sign sin sin_ sinh sinh_ split sqrt sqrt_ squeeze stack std sub sum swapaxes swapdims tan
tan_ tanh tanh_ tensor_split tile transpose trunc trunc_ unbind unflatten unsqueeze var where zeros_like
""".split())
