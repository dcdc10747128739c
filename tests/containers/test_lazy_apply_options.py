"""A lazy stack's apply/named_apply/update and tensordict 0.15.3's keywords: update takes
entries as keywords; the apply keyword not built for lazy stacks (is_leaf) raises a TypeError that
names the option and the public method (it named our mixin class LazyShapeOps)."""
import pytest
import torch

import shared_td


def _stack():
    return shared_td.lazy_stack([shared_td.TensorDict(a=torch.zeros(2), batch_size=[2])] * 2)


@pytest.mark.parametrize("method", ["apply", "named_apply"])
@pytest.mark.parametrize("option", ["is_leaf"])  # (the others are built: test_session22_lazy.py)
def test_an_apply_option_not_built_is_named(method, option):
    fn = (lambda x: x) if method == "apply" else (lambda key, x: x)
    with pytest.raises(TypeError, match=rf"^LazyStackedTensorDict\.{method}\({option}=\.\.\.\): tensordict 0\.15\.3's"):
        getattr(_stack(), method)(fn, **{option: None})


def test_an_unknown_keyword_names_the_public_method():
    with pytest.raises(TypeError, match=r"^LazyStackedTensorDict\.apply\(\) got an unexpected keyword argument 'bogus'"):
        _stack().apply(lambda x: x, bogus=1)


def test_update_takes_entries_as_keywords():
    stack = _stack()
    assert stack.update(a=torch.ones(2, 2)) is stack
    assert stack["a"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(TypeError, match=r"update\(is_leaf=\.\.\.\)"):
        stack.update({}, is_leaf=lambda cls: True)
