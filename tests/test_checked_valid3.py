"""Valid custom Functions and calls pass checked mode without a word, and checked mode's
messages fit what was passed."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv


def _leaf(*shape, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).requires_grad_(requires_grad)


def _silent_grads(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` inside ``tv.checked()``, asserting that nothing is warned."""
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args, **kwargs)


def _stop_grad_first(needs_input_grad_tested):
    class StopGradFirst(torch.autograd.Function):
        """a + b, with the gradient to ``a`` blocked on purpose (backward returns None for
        it); the gradient to ``b`` computed whether it needs one or not, or only if so."""

        @staticmethod
        def forward(ctx, a, b):
            return a + b

        @staticmethod
        def backward(ctx, g):
            if needs_input_grad_tested and not ctx.needs_input_grad[1]:
                return None, None
            return None, g

    return StopGradFirst


def test_none_next_to_a_dropped_gradient_of_its_shape_names_both_readings():
    # a needs a gradient and gets None (by design, or swapped with the g given for b?);
    # b needs none and gets g, which torch drops. The node records nothing of b, so the
    # two readings look the same: the warning names both, torch's result stands, and the
    # second reading's good practice (None where ctx.needs_input_grad is False) ends it
    a, b = _leaf(3), _leaf(3, seed=1, requires_grad=False)
    fn = _stop_grad_first(False)
    with tv.checked(), pytest.warns(tv.FunctionCheckWarning) as caught:
        (got,) = torch.autograd.grad(fn.apply(a, b).sum(), a, allow_unused=True)
    (reference,) = torch.autograd.grad(fn.apply(a, b).sum(), a, allow_unused=True)
    assert got is None and reference is None
    said = str(caught[0].message)
    assert "returned None at index 0, where forward input 0 (shape (3,)) requires grad, and " \
           "a tensor of shape (3,) at index 1, where forward input 1 needs no gradient" in said
    assert "cannot tell which of two cases this is" in said, said
    assert "if the output does not depend on input 0 (None meant), nothing is wrong" in said
    assert "return dL/d(input 0) at index 0, and None at index 1" in said, said
    assert "ctx.needs_input_grad[1]" in said, said
    # the good practice: no warning, the same results through each entry point
    fn = _stop_grad_first(True)
    (got,) = _silent_grads(
        lambda: torch.autograd.grad(fn.apply(a, b).sum(), a, allow_unused=True))
    assert got is None
    c = _leaf(3, seed=2)
    _silent_grads(lambda: (fn.apply(a, b) * c).sum().backward())
    assert a.grad is None
    assert torch.equal(c.grad, (a + b).detach())
    (gc,) = _silent_grads(lambda: tv.grad((fn.apply(a, b) * c).sum(), [c]))
    assert torch.equal(gc, (a + b).detach())


@pytest.mark.parametrize("call", ["tv.grad", "checked grad", "checked backward"])
def test_a_dict_of_losses_as_outputs_is_explained_as_a_dict(call):
    x = _leaf(3)
    losses = {"ce": (x * x).sum(), "reg": x.abs().sum()}
    run = {
        "tv.grad": lambda: tv.grad(losses, [x]),
        "checked grad": lambda: torch.autograd.grad(losses, [x]),
        "checked backward": lambda: torch.autograd.backward(losses),
    }[call]
    with pytest.raises(AssertionError) as plain:  # torch reads the dict by its keys
        torch.autograd.grad(losses, [x])
    with tv.checked(), pytest.raises(AssertionError) as info:
        run()
    assert str(info.value) == str(plain.value)  # torch's own sentence first
    (note,) = info.value.__notes__
    name = "tensors" if call == "checked backward" else "outputs"
    assert note.startswith(
        f"{'torch_vjp.grad' if call == 'tv.grad' else 'torch.autograd.' + call.split()[1]}: "
        f"{name} is a dict, but it must be a tensor or a sequence of tensors: a dict is read "
        f"by its keys, so {name}[0] is its key 'ce', not one of its values.")
    assert f"sum({name}.values())" in note and f"list({name}.values())" in note
    assert ".item()" not in note
    # the fix it gives works: the gradient of the total loss
    (got,) = _silent_grads(lambda: torch.autograd.grad(list(losses.values()), [x]))
    assert torch.allclose(got, 2 * x.detach() + x.detach().sign())


@pytest.mark.parametrize("entry, fix", [
    ("dict", "Fix: put the tensors it holds, list(outputs[0].values()), in its place: outputs "
             "is one flat sequence of tensors (and grad_outputs too, in the same order)."),
    ("list", "Fix: put the tensors it holds in its place: outputs is one flat sequence of "
             "tensors (and grad_outputs too, in the same order)."),
    ("float", "Fix: pass the tensor itself (.item() gives a number, which holds no graph)."),
])
def test_an_entry_of_outputs_that_holds_tensors_is_not_told_of_item(entry, fix):
    x = _leaf(3)
    l1, l2 = (x * x).sum(), x.abs().sum()
    value = {"dict": {"ce": l1, "reg": l2}, "list": [l1, l2], "float": l1.item()}[entry]
    with tv.checked(), pytest.raises(AssertionError) as info:
        torch.autograd.grad([value], [x])
    (note,) = info.value.__notes__
    assert note.startswith(f"torch.autograd.grad: outputs[0] is a {entry}, but each entry of "
                           f"outputs must be a tensor")
    assert note.endswith(fix)


def test_check_grad_outputs_explains_a_dict_of_losses_as_a_dict():
    x = _leaf(3)
    losses = {"ce": (x * x).sum(), "reg": x.abs().sum()}
    with pytest.raises(tv.GradOutputsTypeError) as info:
        tv.check_grad_outputs(losses, None)
    said = str(info.value)
    assert "outputs is a dict, but it must be a tensor or a sequence of tensors: a dict is " \
           "read by its keys, so outputs[0] is its key 'ce'" in said, said
    assert "sum(outputs.values())" in said and ".item()" not in said, said
    assert len(tv.check_grad_outputs(list(losses.values()), None)) == 2
