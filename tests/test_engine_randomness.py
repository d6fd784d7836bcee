"""Jacobians of functions that draw random numbers (dropout in training mode, torch.rand):
every strategy and chunking gives the Jacobian of the one draw a call of f makes, as
torch.func.jacrev does, and leaves the generator as one call of f leaves it (NOTE [forward
mode of a function that draws])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv

D = torch.float64
STRATEGIES = ["fwd", "rev", "auto", "fwd-loop", "rev-loop"]
CHUNKS = [None, 1, 2, 3, 7, 1000]


def _f(x):
    mixed = x.sum() * torch.ones(8, dtype=D) + x.repeat(2)[:8]
    return F.dropout(mixed, 0.5, training=True) * torch.rand((), dtype=D)


@pytest.mark.parametrize("chunk_size", CHUNKS, ids=lambda c: f"chunk={c}")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_jacobian_of_a_random_function_is_that_of_one_draw(strategy, chunk_size):
    x = torch.randn(6, dtype=D)
    torch.manual_seed(3)
    expected = torch.func.jacrev(_f)(x)
    after_one_call = torch.get_rng_state()
    torch.manual_seed(3)
    J = tv.jacobian(_f, x, strategy=strategy, chunk_size=chunk_size)
    torch.testing.assert_close(J, expected, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), after_one_call)


def test_forward_mode_within_a_memory_budget_draws_once():
    # max_memory for the result and chunks of about two columns (448 B of work each)
    x = torch.randn(6, dtype=D)
    torch.manual_seed(5)
    expected = torch.func.jacrev(_f)(x)
    torch.manual_seed(5)
    J = tv.jacobian(_f, x, strategy="fwd", max_memory=1300)
    torch.testing.assert_close(J, expected, rtol=0, atol=0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_jacobian_and_hessian_of_a_random_function(strategy):
    xb = torch.randn(4, 3, dtype=D)

    def rows(v):
        return F.dropout(v.sin(), 0.5, training=True)

    torch.manual_seed(2)
    mask = F.dropout(torch.ones(4, 3, dtype=D), 0.5, training=True)
    torch.manual_seed(2)
    B = tv.batch_jacobian(rows, xb, strategy=strategy, chunk_size=2)
    torch.testing.assert_close(B, torch.diag_embed(mask * xb.cos()), rtol=0, atol=1e-15)

    x = torch.randn(5, dtype=D)

    def g(v):
        return (F.dropout(v, 0.5, training=True) ** 3).sum()

    torch.manual_seed(1)
    m = F.dropout(torch.ones(5, dtype=D), 0.5, training=True)
    torch.manual_seed(1)
    H = tv.hessian(g, x, strategy=strategy)
    torch.testing.assert_close(H, torch.diag(6 * x * m ** 3))
