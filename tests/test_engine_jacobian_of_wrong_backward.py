"""torch_vjp.jacobian_of reads the Jacobian from a graph already built, one backward pass
per output element: where that graph holds an operator whose backward torch computes
wrongly (torch 2.13: torch.as_strided_scatter for the tensor scattered into, the
antialiased resize's wrong cases), on a path to the inputs, it refuses, naming forward mode
from the function (NOTE [named reverse strategies and wrong formulas]); the right cases
are computed. float64, against forward-mode columns (torch.func.jvp, jacfwd) and finite differences."""
import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

from _references import central_difference as _fd, jvp_columns as _jvp_columns

D = torch.float64


def _x(*shape, seed=0):
    return torch.randn(shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _resize(x):
    return F.interpolate(x, mode="bicubic", antialias=True, size=(11, 1))


_S = _x(2, seed=1)


def _scatter(x):
    return torch.as_strided_scatter(x * 1.0, _S * x[:2], (2,), (1,), 0) * x.sum()


@pytest.mark.parametrize("f,x,op,fwd", [
    (_resize, _x(1, 1, 6, 1),
     "torch.nn.functional.interpolate(mode='bicubic', antialias=True)", "'fwd'"),
    (_scatter, _x(4), "torch.as_strided_scatter", "'fwd-loop'"),
], ids=["resize", "scatter"])
def test_refused_where_the_graph_holds_a_wrong_backward(f, x, op, fwd):
    want = _jvp_columns(f, x)
    torch.testing.assert_close(want, _fd(f, x))
    xr = x.clone().requires_grad_(True)
    y = f(xr)
    with pytest.raises(tv.JacobianCallError) as err:
        tv.jacobian_of(y, xr)
    msg = str(err.value)
    assert msg.startswith(f"torch_vjp.jacobian_of: the outputs' graph goes through {op}, "
                          f"and torch's backward formula of it is wrong for ")
    assert "so a Jacobian read from the graph (one backward pass per output element) " \
           "would be wrong" in msg
    assert f"Fix: compute the Jacobian from the function that made the outputs, with " \
           f"forward mode, whose formula is right: torch_vjp.jacobian(f, x, " \
           f"strategy={fwd})" in msg
    # the fix it names is right
    torch.testing.assert_close(tv.jacobian(f, x, strategy=fwd.strip("'")), want)


def test_right_resize_and_other_inputs_are_computed():
    # a resize torch differentiates right
    x = _x(1, 1, 6, 4).requires_grad_(True)

    def f(x):
        return F.interpolate(x, mode="bilinear", antialias=True, size=(11, 7))

    torch.testing.assert_close(tv.jacobian_of(f(x), x), torch.func.jacfwd(f)(x.detach()))
    # the wrong gradient goes to another tensor that requires grad, not to the input
    w = _x(1, 1, 6, 1, seed=2).requires_grad_(True)
    u = _x(11, seed=3).requires_grad_(True)
    y = _resize(w).reshape(11) * u.sin()
    want = torch.func.jacfwd(lambda u: _resize(w.detach()).reshape(11) * u.sin())(u.detach())
    torch.testing.assert_close(tv.jacobian_of(y, u), want)
    with pytest.raises(tv.JacobianCallError):
        tv.jacobian_of(y, w)
