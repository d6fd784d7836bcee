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


class _StopGradFirst(torch.autograd.Function):
    """a + b, with the gradient to ``a`` blocked on purpose (backward returns None for it)
    and the gradient to ``b`` computed without testing ``ctx.needs_input_grad``."""

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        return None, g


class _ZeroFirst(torch.autograd.Function):
    """a * 0 + b: the true gradient of ``a`` is zero, returned as a tensor of zeros next to
    the gradient of ``b``, of the same shape."""

    @staticmethod
    def forward(ctx, a, b):
        return a * 0 + b

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g), g


@pytest.mark.parametrize("b_needs_grad", [False, True])
@pytest.mark.parametrize("fn", [_StopGradFirst, _ZeroFirst], ids=["None", "zeros"])
def test_a_zero_gradient_next_to_one_of_its_shape_is_not_misplaced(fn, b_needs_grad):
    # a gets a zero gradient (None or zeros), b gets g, of a's shape: valid code. Where b
    # needs no gradient torch drops g; the node records nothing of b, so it holds no
    # evidence that the two were swapped: no warning, torch's results unchanged
    a, b = _leaf(3), _leaf(3, seed=1, requires_grad=b_needs_grad)
    inputs = [a, b] if b_needs_grad else [a]
    got = _silent_grads(
        lambda: torch.autograd.grad(fn.apply(a, b).sum(), inputs, allow_unused=True))
    reference = torch.autograd.grad(fn.apply(a, b).sum(), inputs, allow_unused=True)
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        assert (g is None and r is None) or torch.equal(g, r)
    # the same through Tensor.backward and tv.grad, with a third input that needs a gradient
    c = _leaf(3, seed=2)
    _silent_grads(lambda: (fn.apply(a, b) * c).sum().backward())
    assert torch.equal(c.grad, (a + b).detach() if fn is _StopGradFirst else b.detach())
    (gc,) = _silent_grads(lambda: tv.grad((fn.apply(a, b) * c).sum(), [c]))
    assert torch.equal(gc, c.grad)


class _Swapped(torch.autograd.Function):
    """a * b.sum() (a of shape (3,), b of shape (4,)), whose backward returns the two
    gradients in each other's places."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b.sum()

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return (g * a).sum().expand(4), g * b.sum()


def test_gradients_swapped_between_inputs_of_different_shapes_are_still_reported():
    a, b = _leaf(3), _leaf(4, seed=1)
    with tv.checked(), pytest.raises(tv.FunctionCheckError) as info:
        torch.autograd.grad(_Swapped.apply(a, b).sum(), [a, b])
    assert "_Swapped.backward returned a gradient of shape (4,) at index 0, but forward " \
           "input 0 has shape (3,)" in info.value.explanation, info.value.explanation


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
    ("str", "Fix: pass the tensor itself."),
])
def test_an_entry_of_outputs_that_holds_tensors_is_not_told_of_item(entry, fix):
    x = _leaf(3)
    l1, l2 = (x * x).sum(), x.abs().sum()
    value = {"dict": {"ce": l1, "reg": l2}, "list": [l1, l2], "float": l1.item(),
             "str": "loss"}[entry]
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
