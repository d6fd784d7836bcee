"""jacobian_of on graphs with tensors that retain their gradient (``Tensor.retain_grad()``)
inside them, not only at the outputs and inputs: the Jacobian against torch.func.jacrev in
float64, and every ``.grad`` as it was (NOTE [retain_grad inside the graph])."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

OPTIONS = [
    pytest.param({}, id="one-chunk"),
    pytest.param({"chunk_size": 1}, id="loop"),
    pytest.param({"chunk_size": 2}, id="chunks-of-2"),
    pytest.param({"create_graph": True}, id="create_graph"),
]


def _f(x):
    return (x.sin() * 2).exp() * x.sqrt()


def _graph(x0):
    x = x0.clone().requires_grad_()
    h = x.sin()
    h.retain_grad()
    h2 = (h * 2).exp()
    h2.retain_grad()
    return x, h, h2, h2 * x.sqrt()


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("backward_first", [False, True], ids=["no-grad-yet", "grad-set"])
def test_jacobian_of_with_intermediates_retaining_grad(options, backward_first):
    x0 = torch.rand(5, dtype=torch.float64) + 0.1
    expected = torch.func.jacrev(_f)(x0)
    x, h, h2, y = _graph(x0)
    if backward_first:
        y.sum().backward(retain_graph=True)
    before = [None if t.grad is None else t.grad.clone() for t in (h, h2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        J = tv.jacobian_of(y, x, retain_graph=True, **options)
        J_again = tv.jacobian_of(y, x, retain_graph=True, **options)  # the graph is whole
    torch.testing.assert_close(J, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(J_again, expected, rtol=1e-12, atol=1e-12)
    for t, b in zip((h, h2), before):
        if b is None:
            assert t.grad is None
        else:
            assert torch.equal(t.grad, b)
            assert not torch._C._functorch.is_batchedtensor(t.grad)
    # the user's own backward pass afterwards works, and adds as it would have
    y.sum().backward()
    x_ref, h_ref, h2_ref, y_ref = _graph(x0)
    if backward_first:
        y_ref.sum().backward(retain_graph=True)
    y_ref.sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(h2.grad, h2_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_retaining_intermediate_whose_python_object_is_gone():
    # h is saved by the graph (h * h) and retains its gradient; the user dropped h itself
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    h = x.sin()
    h.retain_grad()
    y = h * h
    del h
    J = tv.jacobian_of(y, x, retain_graph=True, chunk_size=2)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.sin() ** 2)(x.detach()))
    y.sum().backward()  # (no batched tensor left in the saved h's .grad)
    torch.testing.assert_close(x.grad, torch.func.grad(lambda v: (v.sin() ** 2).sum())(
        x.detach()))


def test_retaining_intermediate_with_several_outputs_and_inputs():
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    m = torch.outer(a, b)
    m.retain_grad()
    outs = (m.tanh().sum(1), (m * 3).sum())
    J = tv.jacobian_of(outs, (a, b), retain_graph=True)
    expected = torch.func.jacrev(lambda a, b: (torch.outer(a, b).tanh().sum(1),
                                               (torch.outer(a, b) * 3).sum()),
                                 argnums=(0, 1))(a.detach(), b.detach())
    torch.testing.assert_close(J, expected)
    assert m.grad is None


def _retains_inside(x):
    h = x.sin()
    if h.requires_grad:  # (forward mode's tensors do not require grad)
        h.retain_grad()
    return h * x


def test_a_function_calling_retain_grad_is_explained_or_computed():
    # torch.func refuses Tensor.retain_grad() inside the function it transforms; the
    # vectorised reverse strategy let torch's bare RuntimeError through, unexplained
    x = torch.randn(4, dtype=torch.float64)
    expected = torch.func.jacrev(lambda v: v.sin() * v)(x)
    with pytest.raises(tv.StrategyError, match=(
            r"(?s)^torch_vjp\.jacobian: the vectorised strategies compute with torch\.func, "
            r"which cannot run f \(_retains_inside\) in rev-mode products: f runs plain "
            r"autograd itself \(.*\.retain_grad\(\).*\)\, which torch\.func's transforms "
            r"refuse .*torch\.func said: RuntimeError: You are attempting to call "
            r"Tensor\.retain_grad\(\).*Fix: strategy='auto', 'rev-loop' or 'fwd-loop'")):
        tv.jacobian(_retains_inside, x, strategy="rev")
    for strategy in ("auto", "fwd", "rev-loop", "fwd-loop"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            torch.testing.assert_close(tv.jacobian(_retains_inside, x, strategy=strategy),
                                       expected)
