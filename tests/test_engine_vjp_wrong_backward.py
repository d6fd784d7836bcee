"""torch_vjp.vjp through an operator whose backward formula torch (2.13) has wrong
(torch.as_strided_scatter, for the tensor scattered into): vjp_fn refuses, batched or not,
rather than return a wrong v^T J; the fix it names is right. float64, against
torch.func.jvp columns."""

import pytest
import torch

import torch_vjp as tv

from _references import jvp_columns as _jvp_columns

D = torch.float64


def _scatter_f():
    s = torch.randn(2, dtype=D, generator=torch.Generator().manual_seed(0))

    def f(x):
        return torch.as_strided_scatter(x * 1.0, s * x[:2], (2,), (1,), 0) * x.sum()

    return f


@pytest.mark.parametrize("batched", [False, True])
def test_vjp_through_as_strided_scatter_is_refused_and_names_forward_mode(batched):
    f = _scatter_f()
    x = torch.randn(4, dtype=D)
    J = _jvp_columns(f, x)
    v = torch.randn(3, 4, dtype=D) if batched else torch.randn(4, dtype=D)
    # (torch.func.vjp's product is wrong: the case refused)
    assert not torch.allclose(torch.func.vjp(f, x)[1](v[0] if batched else v)[0],
                              (v[0] if batched else v) @ J)
    out, vjp_fn = tv.vjp(f, x)
    torch.testing.assert_close(out, f(x))  # (the output is right and handed back)
    with pytest.raises(tv.JacobianCallError) as info:
        vjp_fn(v, batched=batched)
    msg = str(info.value)
    assert msg == (
        "torch_vjp.vjp: vjp_fn: torch's backward formula of torch.as_strided_scatter is "
        "wrong for the tensor scattered into (the gradient of that tensor is passed inside "
        "the scattered region rather than outside it), which f (_scatter_f.<locals>.f) "
        "computes from the "
        "primals, so v^T J would be wrong (torch.func.vjp's too), batched or not.\n"
        "  Fix: compute with forward mode, whose formula is right: torch_vjp.jvp(f, "
        "primals, tangents) for J t, or torch_vjp.jacobian(f, *primals, "
        "strategy='fwd-loop') and v^T J from it (torch.vmap has no batching rule for "
        "torch.as_strided_scatter, so 'fwd' cannot run it).")
    # the fix it names is right
    Jf = tv.jacobian(f, x, strategy="fwd-loop")
    torch.testing.assert_close(Jf, J)
    torch.testing.assert_close(v @ Jf, v @ J)
    e = torch.eye(4, dtype=D)[1]
    torch.testing.assert_close(tv.jvp(f, (x,), (e,))[1], J[:, 1])


@pytest.mark.parametrize("batched", [False, True])
def test_vjp_scattering_into_a_constant_is_not_refused(batched):
    # (the gradient of the scattered source is right: only the tensor scattered into's is not)
    def f(x):
        return torch.as_strided_scatter(torch.zeros(9, dtype=D), x, (2, 2), (1, 2), 1) * 2.0

    x = torch.randn(2, 2, dtype=D)
    J = _jvp_columns(f, x)
    v = torch.randn(3, 9, dtype=D) if batched else torch.randn(9, dtype=D)
    (got,) = tv.vjp(f, x)[1](v, batched=batched)
    torch.testing.assert_close(got, torch.tensordot(v, J, dims=1))


def test_vjp_of_a_function_without_the_operator_is_unchanged():
    W = torch.randn(3, 4, dtype=D)
    x = torch.randn(4, dtype=D)
    v = torch.randn(3, dtype=D)
    (got,) = tv.vjp(lambda x: W @ x.sin(), x)[1](v)
    torch.testing.assert_close(got, (v @ W) * x.cos())
