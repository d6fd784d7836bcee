"""strategy='auto' through a forward-mode formula torch has wrong, at a degenerate first
point (NOTE [forward mode through a wrong formula] in torch_vjp/_engine/fwd_wrong.py): for a
tall Jacobian "auto" starts from forward mode and checks it against a reverse product; at
zeros, or where f multiplies torch.scatter_reduce(reduce='prod') by a sum that is 0, the
wrong formula agreed, forward mode was remembered, and later calls were wrong by 5-7
without a word. float64, against a per-row torch.autograd.grad loop."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

from _references import caught

D = torch.float64
IDX = torch.tensor([0, 1, 1, 2, 2, 0, 3, 3])

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _per_row(f, x):
    xx = x.detach().clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True)[0] for i in range(out.numel())]
    return torch.stack(rows).reshape(*f(x).shape, *x.shape)


def _tall():
    def f(a):  # (4 inputs, 804 outputs: "auto" starts from forward mode)
        y = torch.ones(4, dtype=D).scatter_reduce(0, IDX, a.repeat(2), "prod",
                                                  include_self=False)
        return torch.cat([y * a.sum(), a.sin().repeat(200)])
    return f


def _summing_to_zero():
    v = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))
    return v - v.mean()


_X1 = torch.rand(4, dtype=D, generator=torch.Generator().manual_seed(4)) + 0.5


@pytest.mark.parametrize("first", [lambda: torch.zeros(4, dtype=D), _summing_to_zero],
                         ids=["zeros", "sum-zero"])
def test_auto_takes_reverse_mode_where_a_wrong_forward_formula_agreed(first):
    f = _tall()
    x0 = first()
    t = torch.randn(4, dtype=D)
    # (the premise: forward mode agrees at x0 and is wrong at _X1)
    _, at0 = torch.func.jvp(f, (x0,), (t,))
    torch.testing.assert_close(at0, _per_row(f, x0) @ t)
    assert (torch.func.jvp(f, (_X1,), (t,))[1] - _per_row(f, _X1) @ t).abs().max() > 1
    said = []
    for x in (x0, _X1, x0, _X1):
        J, words = caught(lambda: tv.jacobian(f, x))
        said += words
        torch.testing.assert_close(J, _per_row(f, x))
    assert len(said) == 1
    msg = said[0]
    assert msg.startswith("torch_vjp.jacobian: forward mode (strategy='auto' chooses it for a "
                          "Jacobian with more output than input elements) agrees with a "
                          "reverse product at this point, but it runs torch's forward-mode "
                          "formula of torch.scatter_reduce(reduce='prod') in f (")
    assert "only by a coincidence of the point" in msg
    assert "computed the Jacobian with reverse mode" in msg
    assert "Pass strategy='rev' to compute it that way directly" in msg


def test_auto_at_a_random_first_point_keeps_its_own_check():
    f = _tall()
    said = []
    for x in (_X1, _X1 + 1):
        J, words = caught(lambda: tv.jacobian(f, x))
        said += words
        torch.testing.assert_close(J, _per_row(f, x))
    assert len(said) == 1 and "disagrees with a reverse product" in said[0]


def test_a_right_formula_keeps_forward_mode_silently():
    def f(a):
        y = torch.ones(4, dtype=D).scatter_reduce(0, IDX, a.repeat(2), "amax")
        return torch.cat([y * a.sum(), a.sin().repeat(200)])

    from torch_vjp._engine import fwdcheck

    for x in (torch.zeros(4, dtype=D), _X1):
        J, words = caught(lambda: tv.jacobian(f, x))
        assert words == []
        torch.testing.assert_close(J, _per_row(f, x))
    assert "fwd" in fwdcheck.CHECKED.values()
