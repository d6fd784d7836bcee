"""torch's (2.13) backward of the antialiased resize (F.interpolate, mode='bilinear' or
'bicubic', antialias=True) is wrong for its input where the output is one column wide and
its height is resampled, or where a dimension keeps its size under a scale_factor other
than 1: named
reverse strategies, torch_vjp.vjp's vjp_fn and a Hessian through it refuse, with forward
mode as the fix (NOTE [named reverse strategies and wrong formulas]); "auto" returns
forward mode's Jacobian; where the backward is right, nothing is refused. float64, against
finite differences and torch.func.jacfwd."""
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

from _references import central_difference as _fd

D = torch.float64


# (each test sees its own first call of "auto": conftest's fresh_route_checks)
pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _resize(mode, **kw):
    def f(x):
        return F.interpolate(x, mode=mode, antialias=True, **kw)
    return f


# (input shape, keywords): every one of torch's wrong cases found
WRONG = [((1, 1, 6, 1), dict(scale_factor=(1.95, 1.27))),
         ((1, 1, 6, 1), dict(size=(11, 1))),
         ((2, 3, 6, 4), dict(size=(12, 1))),
         ((1, 1, 3, 3), dict(scale_factor=(1.6, 1.27))),
         ((1, 1, 6, 2), dict(size=(12, 1), align_corners=True))]
WRONG += [((1, 1, 2, 3), dict(scale_factor=(1.05, 1.0))),
          ((1, 2, 6, 3), dict(scale_factor=(1.05, 0.4)))]
RIGHT = [((1, 1, 6, 4), dict(size=(11, 7))),
         ((1, 1, 6, 4), dict(scale_factor=2.0)),
         ((2, 2, 6, 4), dict(size=(6, 1))),
         ((1, 3, 7, 9), dict(scale_factor=0.5)),
         ((1, 3, 7, 9), dict(scale_factor=1.5)),
         ((1, 2, 9, 5), dict(scale_factor=(1.3, 0.7))),
         ((1, 1, 1, 5), dict(size=(3, 1)))]


def _x(shape):
    return torch.randn(shape, dtype=D, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("shape,kw", WRONG)
@pytest.mark.parametrize("strategy", ["rev", "rev-loop"])
def test_named_reverse_refuses_with_forward_mode_as_the_fix(mode, shape, kw, strategy):
    f, x = _resize(mode, **kw), _x(shape)
    want = _fd(f, x)
    torch.testing.assert_close(torch.func.jacfwd(f)(x), want)
    assert (torch.func.jacrev(f)(x) - want).abs().max() > 0.01  # (torch's bug, still there)
    with pytest.raises(tv.StrategyError) as err:
        tv.jacobian(f, x, strategy=strategy)
    msg = str(err.value)
    assert f"strategy={strategy!r} computes with reverse-mode AD" in msg
    assert (f"backward formula of torch.nn.functional.interpolate(mode={mode!r}, "
            f"antialias=True) is wrong for the input resized (where the output is one column wide"
            ) in msg
    assert "so the Jacobian would be wrong" in msg
    assert "Fix: strategy='fwd' (forward mode, whose formula is right), or 'auto'" in msg
    # the fix it names computes the right Jacobian, and so does "auto"
    torch.testing.assert_close(tv.jacobian(f, x, strategy="fwd"), want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        torch.testing.assert_close(tv.jacobian(f, x), want)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("shape,kw", RIGHT)
def test_right_cases_are_not_refused(mode, shape, kw):
    f, x = _resize(mode, **kw), _x(shape)
    want = torch.func.jacfwd(f)(x)
    torch.testing.assert_close(want, _fd(f, x))
    for strategy in ("rev", "rev-loop"):
        torch.testing.assert_close(tv.jacobian(f, x, strategy=strategy), want)


def test_a_constant_resized_is_not_refused():
    s = _x((1, 1, 6, 1))

    def f(x):
        return F.interpolate(s, mode="bilinear", antialias=True, size=(11, 1)) * x

    x = _x((1, 1, 11, 1)) + 1
    torch.testing.assert_close(tv.jacobian(f, x, strategy="rev"), torch.func.jacfwd(f)(x))


def test_vjp_fn_refuses():
    f, x = _resize("bilinear", scale_factor=(1.95, 1.27)), _x((1, 1, 6, 1))
    y, vjp_fn = tv.vjp(f, x)
    with pytest.raises(tv.JacobianCallError) as err:
        vjp_fn(torch.ones_like(y))
    msg = str(err.value)
    assert "vjp_fn: torch's backward formula of torch.nn.functional.interpolate(" in msg
    assert "so v^T J would be wrong (torch.func.vjp's too)" in msg
    assert "torch_vjp.jacobian(f, *primals, strategy='fwd') and v^T J from it" in msg


def test_hessian_refuses():
    f = _resize("bicubic", size=(11, 1))

    def g(x):
        return (f(x) ** 2).sum()

    x = _x((1, 1, 6, 1))
    want = torch.func.jacfwd(torch.func.jacfwd(g))(x)
    assert (torch.func.hessian(g)(x) - want).abs().max() > 0.05  # (torch's bug, still there)
    for strategy in ("auto", "fwd", "rev"):
        with pytest.raises(tv.JacobianCallError) as err:
            tv.hessian(g, x, strategy=strategy)
        msg = str(err.value)
        assert "so the Hessian would be wrong under every strategy" in msg
        assert "strategy='fwd'), x, strategy='fwd') for a scalar f" in msg
    # the fix it names is right
    got = tv.jacobian(lambda x: tv.jacobian(g, x, strategy="fwd"), x, strategy="fwd")
    torch.testing.assert_close(got, want)


def test_refused_exactly_where_torch_is_wrong():
    """Over random sizes, scales and align_corners: 'rev' refuses where torch.func.jacrev
    differs from forward mode, and returns forward mode's Jacobian everywhere else."""
    gen = torch.Generator().manual_seed(5)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    refused = 0
    for _ in range(60):
        mode, corners = pick(["bilinear", "bicubic"]), pick([False, True])
        shape = (1, 2, pick([1, 2, 3, 5]), pick([1, 2, 3, 5]))
        if pick([True, False]):
            kw = dict(size=(pick([1, 2, 3, 5, 7]), pick([1, 1, 2, 3])))
        else:
            kw = dict(scale_factor=(pick([0.5, 1.0, 1.05, 1.6, 2.0]),
                                    pick([1.0, 0.3, 0.5, 1.27])))
        f = _resize(mode, align_corners=corners, **kw)
        x = torch.randn(shape, dtype=D, generator=gen)
        try:
            want = torch.func.jacfwd(f)(x)
        except RuntimeError:  # (an output size of 0)
            continue
        wrong = (torch.func.jacrev(f)(x) - want).abs().max() > 1e-8
        try:
            got = tv.jacobian(f, x, strategy="rev")
        except tv.StrategyError as err:
            assert wrong, (mode, corners, shape, kw, str(err))
            refused += 1
            continue
        assert not wrong, (mode, corners, shape, kw)
        torch.testing.assert_close(got, want)
    assert refused > 5  # (the draws hold wrong cases)
