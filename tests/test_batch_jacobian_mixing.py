"""batch_jacobian(strategy="auto") of a function that mixes the rows of its batch raises a
JacobianCallError that says so, rather than return a result that is no Jacobian of f (NOTE
[a batch that mixes rows]); a random row-wise f keeps its warning."""

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
        assert "so it is not random" in msg
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


def test_a_random_row_wise_function_still_returns_with_the_warning():
    drop = torch.nn.Dropout(0.5)
    W = torch.randn(3, 3, dtype=D)

    def f(x):
        return drop(torch.tanh(x @ W))

    x = torch.randn(5, 3, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = tv.batch_jacobian(f, x)
    assert J.shape == (5, 3, 3)
    said = [str(w.message) for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert any("no other route agrees with it either: f draws random numbers" in m
               for m in said), said
