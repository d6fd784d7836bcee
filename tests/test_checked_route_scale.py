""""auto"'s check and batched vjp's check compare routes at the scale of the numbers the
products were computed from, where those cancel (NOTE [the scale of what is compared] in
torch_vjp._engine.fwdnoise): valid custom Functions get no false warning, and a wrong
batching rule is still found."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine import fwdcheck

D = torch.float64



class Softmax(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.softmax(x, -1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return s * (g - (g * s).sum(-1, keepdim=True))

    @staticmethod
    def jvp(ctx, t):
        (s,) = ctx.saved_tensors
        return s * (t - (t * s).sum(-1, keepdim=True))


class Cross(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return torch.linalg.cross(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return torch.linalg.cross(b, g), torch.linalg.cross(g, a)

    @staticmethod
    def jvp(ctx, ta, tb):
        a, b = ctx.saved_tensors
        return torch.linalg.cross(ta, b) + torch.linalg.cross(a, tb)


def _jacobian_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    return result, [str(w.message) for w in caught
                    if issubclass(w.category, tv.JacobianWarning)]


def _softmax_rows(x):
    return Softmax.apply(x.unsqueeze(0).expand(6, 3))


def _zero_triple(x, a):
    return (x * Cross.apply(x, a)).sum()  # x . (x x a) = 0: a gradient zero up to rounding


@pytest.mark.parametrize("case", ["softmax-bf16-near-one-hot", "cross-x-3.3x", "x-dot-x-cross-a",
                                  "plain-outer-antisymmetric-part"])
def test_auto_takes_no_false_route_warning(fresh_route_checks, case):
    torch.manual_seed(0)
    a = torch.randn(3, dtype=D)
    if case == "softmax-bf16-near-one-hot":
        x = torch.tensor([8.0, 0.0, 0.0], dtype=torch.bfloat16)
        f = _softmax_rows
    elif case == "cross-x-3.3x":
        x = torch.randn(3, dtype=D)

        def f(x):
            return Cross.apply(x, 3.3 * x)
    elif case == "x-dot-x-cross-a":
        x = torch.randn(3, dtype=D)

        def f(x):
            return _zero_triple(x, a)
    else:  # torch's own operators: x x^T - (x x^T)^T is zero, its Jacobian zero up to rounding
        x = torch.randn(6, dtype=D)

        def f(x):
            return torch.outer(x, x) - torch.outer(x, x).T
    J, said = _jacobian_warnings(lambda: tv.jacobian(f, x))
    assert said == []
    # the route "auto" computed (reverse mode under vmap), and nothing else
    torch.testing.assert_close(J, torch.func.jacrev(f)(x), atol=0, rtol=0)
    if x.dtype is D:  # against an independent reference: torch's own operators
        def plain(x):
            if case == "plain-outer-antisymmetric-part":
                return f(x)
            if case == "cross-x-3.3x":
                return torch.linalg.cross(x, 3.3 * x)
            return (x * torch.linalg.cross(x, a)).sum()
        torch.testing.assert_close(J, torch.func.jacrev(plain)(x), atol=1e-12, rtol=0)
    # remembered as the vectorised route, not the loop
    assert "rev-loop" not in fwdcheck.CHECKED.values()


def test_batched_vjp_with_cotangents_parallel_to_an_input_takes_no_false_warning(fresh_route_checks):
    torch.manual_seed(0)
    a = torch.randn(3, dtype=D)
    b = torch.randn(3, dtype=D)

    def f(b):
        return Cross.apply(a, b)

    V = torch.stack([2 * a, 3.3 * a])  # dL/d(a x b) parallel to a: a x V[k] = 0
    _, vjp_fn = tv.vjp(f, b)
    (got,), said = _jacobian_warnings(lambda: vjp_fn(V, batched=True))
    assert said == []
    want = torch.stack([torch.linalg.cross(v, a) for v in V])
    torch.testing.assert_close(got, want, atol=1e-14, rtol=0)
    assert "rev-loop" not in fwdcheck.CHECKED.values()


def test_a_wrong_batching_rule_is_still_found(fresh_route_checks):
    # torch.cdist's backward batching rule is wrong (a relative error near 1): measuring the
    # products' rounding does not hide it
    x = torch.randn(4, 3, dtype=D)
    y = torch.randn(5, 3, dtype=D)

    def f(x):
        return torch.cdist(x, y)

    J, said = _jacobian_warnings(lambda: tv.jacobian(f, x))
    assert len(said) == 1 and "wrong batching rule (torch.cdist's is one)" in said[0], said
    torch.testing.assert_close(J, torch.func.jacrev(f, chunk_size=1)(x))


def test_linearity_noise_measures_rounding_only():
    from torch_vjp._engine.fwdnoise import linearity_noise, rounding_scale

    w = torch.randn(5, 4, dtype=torch.float32)

    def product(us):
        return [us[0] @ w]

    g = torch.Generator().manual_seed(0)
    noise = linearity_noise(product, lambda: [torch.randn(5, generator=g)])
    assert 0 <= noise < 1e-5  # (float32 rounding of sums of a few numbers near 1)
    assert linearity_noise(lambda us: [None], lambda: [torch.ones(2)]) == 0.0
    assert rounding_scale(float("nan"), torch.float32) == 0.0
    assert rounding_scale(torch.finfo(torch.float32).eps, torch.float32) == 1.0


def test_a_backward_not_linear_in_its_cotangent_is_still_warned_of(fresh_route_checks):
    # a hook that clips the gradient breaks linearity by far more than rounding: measuring
    # the products' rounding must not take that for rounding and hide it
    W = torch.randn(8, 4, dtype=D, generator=torch.Generator().manual_seed(1))

    def f(x):
        h = torch.tanh(W @ x)
        if h.requires_grad:
            h.register_hook(lambda g: g.clamp(-0.1, 0.1))
        return h

    x = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(2))
    _, said = _jacobian_warnings(lambda: tv.jacobian(f, x))
    assert len(said) == 1 and "no other route agrees with it either" in said[0], said


def test_linearity_noise_is_zero_for_a_product_not_linear_in_its_cotangent():
    from torch_vjp._engine.fwdnoise import linearity_noise

    g = torch.Generator().manual_seed(0)
    draw = lambda: [torch.randn(5, generator=g, dtype=D)]  # noqa: E731
    assert linearity_noise(lambda us: [us[0].clamp(-0.1, 0.1)], draw) == 0.0
    assert linearity_noise(lambda us: [us[0] + 0.5], draw) == 0.0
    assert linearity_noise(lambda us: [us[0].abs()], draw) == 0.0
