"""batch_jacobian(strategy="auto") of a function that mixes the rows of its batch raises a
JacobianCallError that says so, rather than return a result that is no Jacobian of f (NOTE
[a batch that mixes rows]); a random row-wise f, or a deterministic row-wise f whose backward
clips its gradient, keeps its warning and its result."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    from torch_vjp import _errors
    from torch_vjp._engine import fwdcheck

    monkeypatch.setattr(_errors, "_WARNED", set())
    saved = dict(fwdcheck.CHECKED)
    fwdcheck.CHECKED.clear()
    yield
    fwdcheck.CHECKED.clear()
    fwdcheck.CHECKED.update(saved)


def _centred():
    W = torch.randn(3, 3, dtype=D)
    return lambda x: torch.tanh(x @ W) - torch.tanh(x @ W).mean(0)


def _batch_jacobian_warned(f, x):
    """``tv.batch_jacobian(f, x)`` and the messages of the JacobianWarnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = tv.batch_jacobian(f, x)
    return J, [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]


@pytest.mark.parametrize("shape", [(5, 3), (40, 3)])  # (tall and wide per-row Jacobians)
def test_a_function_that_centres_over_the_batch_raises_and_names_the_fix(shape):
    f = _centred()
    x = torch.randn(*shape, dtype=D)
    for _ in range(2):  # (nothing remembered: a later call raises too)
        with warnings.catch_warnings():
            warnings.simplefilter("error", tv.JacobianWarning)  # (no warning instead)
            with pytest.raises(tv.JacobianCallError) as info:
                tv.batch_jacobian(f, x)
        assert isinstance(info.value, RuntimeError)
        msg = str(info.value)
        assert msg.startswith(
            "torch_vjp.batch_jacobian: f (_centred.<locals>.<lambda>) mixes examples of the "
            "batch (a mean over the batch, BatchNorm in training mode, attention across "
            "rows): row b of its output depends on other rows of x"), msg
        assert "A reverse product whose cotangent is zero outside rows " in msg, msg
        assert "gives a nonzero gradient on row " in msg, msg
        assert ("Fix: torch_vjp.jacobian(f, x) of the whole batch, and take its diagonal "
                "blocks (J[b, ..., b, ...])") in msg
    # the fix it names: the diagonal blocks of the whole Jacobian (against torch.func.jacrev)
    full = tv.jacobian(f, x)
    want = torch.func.jacrev(f)(x)
    torch.testing.assert_close(full, want)
    b = torch.arange(x.shape[0])
    torch.testing.assert_close(full[b, :, b, :], torch.stack([want[i, :, i, :] for i in b]))


def test_batchnorm_in_training_mode_raises():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
    x = torch.randn(6, 3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the vmap fallback's warning)
        with pytest.raises(tv.JacobianCallError, match="mixes examples of the batch"):
            tv.batch_jacobian(model, x)
    model.eval()  # (row-wise: the per-example Jacobians, against a loop of jacrev)
    got = tv.batch_jacobian(model, x)
    want = torch.stack([torch.func.jacrev(model)(x[i:i + 1])[0, :, 0] for i in range(6)])
    torch.testing.assert_close(got, want)


def test_a_random_row_wise_function_gives_the_blocks_of_its_first_draw():
    # NOTE [auto's extra calls draw what the products draw]: the check sees the products'
    # draw, so a row-wise dropout passes it (it used to warn that no route agreed)
    drop = torch.nn.Dropout(0.5)
    W = torch.randn(3, 3, dtype=D)

    def f(x):
        return drop(torch.tanh(x @ W))

    x = torch.randn(5, 3, dtype=D)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        J = tv.batch_jacobian(f, x)
    torch.manual_seed(0)
    want = torch.func.jacrev(f)(x)
    b = torch.arange(x.shape[0])
    torch.testing.assert_close(J, want[b, :, b, :])


class _ClipGrad(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g.clamp(-0.1, 0.1)

    @staticmethod
    def vmap(info, in_dims, x):
        return x.view_as(x), in_dims[0]

    @staticmethod
    def jvp(ctx, t):
        return t


def _clipped_by_function(W):
    return lambda x: _ClipGrad.apply(torch.tanh(x @ W.T))


def _clipped_by_hook(W):
    def g(x):
        h = torch.tanh(x @ W.T)
        if h.requires_grad:
            h.register_hook(lambda grad: grad.clamp(-0.1, 0.1))
        return h
    return g


@pytest.mark.parametrize("make", [_clipped_by_function, _clipped_by_hook])
def test_a_row_wise_function_whose_backward_clips_is_not_said_to_mix(make):
    # (its reverse product is not linear in the cotangent, so no route agrees with it; no
    # gradient flows across rows, which is what the mixing test looks at)
    W = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    f = make(W)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = tv.batch_jacobian(f, x)
    assert J.shape == (5, 8, 4)
    said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert said and all("mixes examples" not in m for m in said), said
    want = tv.batch_jacobian(f, x, strategy="rev")
    torch.testing.assert_close(J, want)


def test_an_infinite_derivative_in_one_row_is_not_a_mix():
    # (0 * inf is NaN on a row the cotangent leaves out: no flow across rows)
    x = torch.tensor([[0.0], [1.0], [4.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.batch_jacobian(torch.sqrt, x)
    assert J.flatten().tolist() == [float("inf"), 0.5, 0.25]


def test_a_backward_that_gives_something_for_nothing_is_not_said_to_mix():
    # (a hook that adds to every gradient makes a zero cotangent's gradient nonzero: the
    # mixing test cannot tell, so the result stands with the warning)
    W = torch.randn(3, 3, dtype=D)

    def f(x):
        h = torch.tanh(x @ W)
        if h.requires_grad:
            h.register_hook(lambda grad: grad + 0.5)
        return h

    x = torch.randn(5, 3, dtype=D)
    J, said = _batch_jacobian_warned(f, x)
    assert J.shape == (5, 3, 3)
    assert any("no other route agrees with it either" in m for m in said), said
