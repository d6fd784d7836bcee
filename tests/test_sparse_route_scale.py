"""sparse_jacobian's check of its first mode, at the scale of the numbers its products were
computed from (NOTE [the scale of what is compared] in torch_vjp._engine.fwdnoise), as
jacobian's "auto" compares."""

from __future__ import annotations

import warnings

import torch

import torch_vjp as tv


def _antisymmetric(x):
    # (the products cancel: x_i x_j - x_j x_i. Two right modes differ by their rounding only,
    # far above the products' own size, which is zero up to that rounding)
    return torch.outer(x, x) - torch.outer(x, x).T


def test_a_jacobian_that_cancels_takes_no_false_route_warning():
    # "forward mode disagrees with a reverse product ... and no other route agrees" was
    # warned on this exact Jacobian, and its mode remembered as if f were random
    torch.manual_seed(0)
    x = torch.randn(6, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        J = tv.sparse_jacobian(_antisymmetric, x)
    ours = [str(w.message) for w in seen if issubclass(w.category, tv.TorchVJPWarning)]
    assert ours == []
    ref = torch.func.jacrev(_antisymmetric)(x).reshape(36, 6)
    torch.testing.assert_close(J.to_dense(), ref, rtol=0, atol=1e-12)


def test_a_wrong_batching_rule_is_still_found():
    # torch.cdist's backward batching rule is wrong: the vectorised reverse products
    # disagree with the reverse product by far more than their rounding
    torch.manual_seed(0)
    W = torch.randn(4, 3, dtype=torch.float64)

    def f(x):
        return torch.cdist(x, W, p=1.0).reshape(-1)

    x = torch.randn(5, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = tv.sparse_jacobian(f, x)
    ref = torch.stack([torch.autograd.grad(f(x.requires_grad_()).reshape(-1)[i], x)[0].reshape(-1)
                       for i in range(20)])
    torch.testing.assert_close(J.to_dense(), ref, rtol=1e-9, atol=1e-12)
