"""torch's (2.13) backward formula of max_unpool1d/2d/3d where the indices repeat within a
plane: the output element two inputs are written to holds one of them, and reverse mode
passes its gradient to both (wrong by the size of the entries, as op_db's own samples show);
forward mode is right. A named reverse strategy refuses, naming forward mode; "auto" is
right. float64, against central differences and torch.func.jacfwd."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

D = torch.float64

pytestmark = [pytest.mark.usefixtures("fresh_route_checks"),
              pytest.mark.filterwarnings("ignore:There is a performance drop")]


def _central(f, x, eps=1e-6):
    x = x.detach()
    cols = []
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=D)
        e[i] = eps
        e = e.reshape(x.shape)
        cols.append(((f(x + e) - f(x - e)) / (2 * eps)).reshape(-1))
    return torch.stack(cols, 1)


def _case(k, repeat):
    """``(f, v)``: max_unpool{k}d of v at indices of max_pool's, one index repeated."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(2, 2, *([4] * k), dtype=D, generator=g)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[k - 1]
    unpool = (F.max_unpool1d, F.max_unpool2d, F.max_unpool3d)[k - 1]
    v, idx = pool(x, 2, return_indices=True)
    if repeat:
        idx = idx.clone()
        idx.view(-1)[1] = idx.view(-1)[0]  # (two inputs of plane 0 to one output element)

    def f(a):
        return unpool(a, idx, 2, output_size=x.shape[-k:])

    return f, v


@pytest.mark.parametrize("k", [1, 2, 3])
def test_torchs_own_reverse_formula_is_wrong_only_where_indices_repeat(k):
    # (the premise: if torch fixes its formula, the entries in wrongops go)
    for repeat in (False, True):
        f, v = _case(k, repeat)
        fd = _central(f, v)
        rev = torch.func.jacrev(f)(v).reshape(fd.shape)
        torch.testing.assert_close(torch.func.jacfwd(f)(v).reshape(fd.shape), fd)
        assert ((rev - fd).abs().max() > 0.5) == repeat


@pytest.mark.parametrize("strategy", ["rev", "rev-loop"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_named_reverse_refuses_where_indices_repeat(k, strategy):
    f, v = _case(k, True)
    with pytest.raises(tv.StrategyError) as info:
        tv.jacobian(f, v, strategy=strategy)
    msg = str(info.value)
    assert msg.startswith(f"torch_vjp.jacobian: strategy={strategy!r} computes with "
                          f"reverse-mode AD, and torch's backward formula of "
                          f"torch.nn.functional.max_unpool{3 if k == 3 else 2}d")
    assert "is wrong for its input where indices repeat in a plane" in msg
    assert "Fix: strategy='fwd' (forward mode, whose formula is right)" in msg
    J = tv.jacobian(f, v, strategy="fwd")  # (the fix the message names)
    torch.testing.assert_close(J.reshape(-1, v.numel()), _central(f, v))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_named_reverse_is_computed_without_repeats(k):
    f, v = _case(k, False)
    J = tv.jacobian(f, v, strategy="rev")
    torch.testing.assert_close(J.reshape(-1, v.numel()), _central(f, v))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_auto_is_right_where_indices_repeat(k):
    f, v = _case(k, True)
    w = torch.randn(f(v).shape, dtype=D, generator=torch.Generator().manual_seed(5))

    def few(a):  # (fewer outputs than inputs: "auto" starts from reverse mode)
        return (f(a) * w).flatten(2).sum(-1).reshape(-1)[:3]

    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            J = tv.jacobian(few, v)
        torch.testing.assert_close(J.reshape(3, -1), _central(few, v))


def test_vjp_fn_refuses_where_indices_repeat():
    f, v = _case(2, True)
    out, vjp_fn = tv.vjp(f, v)
    with pytest.raises(tv.JacobianCallError, match=r"max_unpool2d .*is wrong for its input "
                       r"where indices repeat(?s:.*)strategy='fwd'"):
        vjp_fn(torch.ones_like(out))


def test_auto_is_right_after_a_first_point_where_the_wrong_products_agree():
    f, v = _case(2, True)
    c = v.reshape(-1)[0].item()
    w = torch.randn(f(v).shape, dtype=D, generator=torch.Generator().manual_seed(5))

    def few(a):  # (a factor 0 at v hides the wrong gradient there, not at v + 0.25)
        return ((f(a) * w).flatten(2).sum(-1) * (a.reshape(-1)[0] - c)).reshape(-1)

    for x in (v, v + 0.25, v):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            J = tv.jacobian(few, x)
        torch.testing.assert_close(J.reshape(4, -1), _central(few, x))
