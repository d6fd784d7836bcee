"""The explicit gradient API (``tv.grad``, ``tv.backward``, ``tv.check_grad_outputs``) against
torch's own functions: what torch does silently is told, what torch accepts is unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

import torch_vjp as tv

_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")
_VALUES = [1.0 + 2.0**-30, -2.0, 0.5]  # (the first is not a float32: a cast shows)


def _leaf(grad_dtype):
    leaf = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    leaf.grad_dtype = grad_dtype
    return leaf


_CALLS = {
    "tv.grad": lambda t, g: tv.grad(t, t, g)[0],
    "tv.grad edge": lambda t, g: tv.grad(get_gradient_edge(t), t, g)[0],
    "tv.backward": lambda t, g: (tv.backward(t, g), t.grad)[1],
    "checked Tensor.backward": lambda t, g: (_checked_backward(t, g), t.grad)[1],
}


def _checked_backward(t, g):
    with tv.checked():
        t.backward(g)


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("call", list(_CALLS), ids=list(_CALLS))
def test_a_vector_of_the_leaf_s_dtype_cast_to_its_grad_dtype_is_told(call):
    # a float64 vector for a float64 leaf whose grad_dtype is float32: torch casts the
    # vector to float32 without a word (its dtype is the output's, so no cast was told)
    ref = _leaf(torch.float32)
    ref.backward(torch.tensor(_VALUES, dtype=torch.float64))
    leaf = _leaf(torch.float32)
    with pytest.warns(tv.GradOutputsWarning) as said:
        got = _CALLS[call](leaf, torch.tensor(_VALUES, dtype=torch.float64))
    msg = str(said[0].message)
    assert "has dtype torch.float64, the dtype of" in msg, msg
    assert "a leaf whose grad_dtype is torch.float32" in msg, msg
    assert "casts the torch.float64" in msg and "to torch.float32 silently" in msg, msg
    assert ".to(torch.float32) to make the cast explicit" in msg, msg
    assert "grad_dtype = None" in msg, msg
    assert got.dtype == torch.float32 == ref.grad.dtype
    torch.testing.assert_close(got, ref.grad, rtol=0, atol=0)


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("grad_dtype", [torch.float64, None], ids=["float64", "None"])
def test_a_vector_the_leaf_keeps_is_not_told(grad_dtype):
    leaf = _leaf(grad_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = tv.grad(leaf, leaf, torch.tensor(_VALUES, dtype=torch.float64))
    assert got.dtype == torch.float64
    # (through a node in between, the leaf's grad_dtype does not reach the vector)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tv.grad(leaf * 1.0, leaf, torch.tensor(_VALUES, dtype=torch.float64))


def _batch_of_matrices(x):
    # (2, 3, 4) from a (24,) input, each output element its own function of the input
    return (x.sin() * torch.arange(1.0, 25.0, dtype=torch.float64)).reshape(2, 3, 4)


@pytest.mark.parametrize("batched", [False, True], ids=["single", "is_grads_batched"])
def test_a_batch_of_transposed_vectors_is_told_mT_not_only_reshape(batched):
    # grad_outputs built as (2, 4, 3) for a (2, 3, 4) output: each matrix transposed. The
    # message offered .reshape alone, which keeps the transposed order of the elements and
    # gives a wrong gradient without a word.
    x = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64, requires_grad=True)
    y = _batch_of_matrices(x)
    v = torch.randn(5, 2, 4, 3, dtype=torch.float64) if batched else \
        torch.randn(2, 4, 3, dtype=torch.float64)
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y, x, v, retain_graph=True, is_grads_batched=batched)
    note = info.value.__notes__[0]
    assert "grad_outputs[0].mT" in note, note
    assert "last two dimensions swapped" in note, note
    (got,) = tv.grad(y, x, v.mT, is_grads_batched=batched)
    J = torch.func.jacrev(_batch_of_matrices)(x.detach())  # (2, 3, 4, 24)
    want = torch.einsum("...abc,abcn->...n", v.mT, J)
    torch.testing.assert_close(got, want)


def test_dimensions_in_another_order_are_told_the_permutation():
    x = torch.linspace(-1.0, 1.0, 24, dtype=torch.float64, requires_grad=True)
    y = _batch_of_matrices(x)  # (2, 3, 4)
    v = torch.randn(3, 4, 2, dtype=torch.float64)  # y's dimensions as (1, 2, 0)
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y, x, v, retain_graph=True)
    note = info.value.__notes__[0]
    assert "grad_outputs[0].permute(2, 0, 1)" in note, note
    assert v.permute(2, 0, 1).shape == y.shape
    # where sizes repeat, the order is not told from the shapes: no permutation is guessed
    z = (x.sin() * 2).reshape(2, 3, 2, 2)
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(z, x, torch.ones(3, 2, 2, 2, dtype=torch.float64))
    assert "permute" not in info.value.__notes__[0], info.value.__notes__[0]


def _message(fn):
    with pytest.raises(tv.GradOutputsError) as info:
        fn()
    return str(info.value) + "\n" + "\n".join(getattr(info.value, "__notes__", []))


def test_a_loss_cut_from_its_parameters_is_not_told_only_to_set_requires_grad():
    # loss.backward() with no inputs to look at: a loss computed under torch.no_grad() from
    # a parameter that requires grad was told only 'Fix: create the inputs with
    # requires_grad=True', which the parameter already was
    w = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    with torch.no_grad():
        loss = (w * w).sum()
    for call in (lambda: tv.backward(loss), lambda: _checked_backward(loss, None)):
        msg = _message(call)
        assert "does not require grad" in msg, msg
        assert "the graph was cut on the way" in msg, msg
        assert "compute it with grad mode on" in msg, msg
        assert "create the inputs with requires_grad=True" in msg, msg  # (the other cause)
    assert w.grad is None


def test_a_call_where_grad_mode_is_off_says_so():
    # the whole step inside torch.no_grad() (or inference_mode): the cause is the block
    # the call itself runs in, which the message names
    w = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            loss = (w * w).sum()
            msg = _message(lambda: tv.backward(loss))
            msg_grad = _message(lambda: tv.grad(loss, w))
        for m in (msg, msg_grad):
            assert "grad mode is off where this call runs" in m, m
            assert "torch.enable_grad()" in m, m
            assert "create the inputs with requires_grad=True" not in m, m
    # with grad mode on, the same refusal does not blame the mode
    with torch.no_grad():
        loss = (w * w).sum()
    assert "grad mode is off where" not in _message(lambda: tv.grad(loss, w))
    (g,) = tv.grad((w * w).sum(), w)
    torch.testing.assert_close(g, 2 * w.detach())
