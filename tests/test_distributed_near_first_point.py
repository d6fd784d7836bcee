"""Sharded strategy="auto" at a degenerate first point (NOTE [auto, checked near the point]
in torch_vjp._engine.nearcheck): where the modes agree at x and disagree near it, the
sharded check takes forward mode like one process, and its warning gives the numbers near
x, where they disagree (it gave those at x, which agree); where only the rows under vmap
are wrong near x, it takes the rows one reverse product at a time, like one process, and
says so. float64, a one-rank gloo group."""

from __future__ import annotations

import re

import pytest
import torch

import torch_vjp as tv

from _references import WrongBackward, WrongBatched, caught, jvp_columns

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _reverse_rows(f, x):
    xx = x.clone().requires_grad_(True)
    out = f(xx).reshape(-1)
    rows = [torch.autograd.grad(out[i], xx, retain_graph=True)[0] for i in range(out.numel())]
    return torch.stack(rows).reshape(*f(x).shape, *x.shape)


def _products(u):
    return WrongBackward.apply(u[1:] * u[:-1]).sin()


def test_sharded_auto_at_zeros_takes_forward_mode_and_says_the_numbers_near_x(one_rank_group):
    x1 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))
    said = []
    for x in (torch.zeros(8, dtype=D), x1):
        got, words = caught(lambda: tv.jacobian(_products, x, process_group=one_rank_group))
        said += words
        torch.testing.assert_close(got, jvp_columns(_products, x))
    assert len(said) == 1
    assert "at a point near x" in said[0]
    # the numbers said are those near x, where the two products disagree
    m = re.search(r"u\^T J v: (\S+) by reverse mode, (\S+) by forward mode", said[0])
    assert m is not None and abs(float(m[1]) - float(m[2])) > 0.1, said[0]


def _batched_products(u):
    return WrongBatched.apply(u).sin() * u.sum()


def test_sharded_auto_where_only_the_rows_under_vmap_are_wrong_near_x(one_rank_group):
    # (a point summing to 0: the backward, whose batching rule is wrong, is multiplied by 0
    # there; near it the rows under vmap are wrong, the reverse product without vmap right.
    # The sharded check said the reverse product itself disagreed with the forward product,
    # quoting three equal numbers, and took forward mode; one process takes the rows one at
    # a time and says so)
    x0 = torch.tensor([1.0, -2.0, 0.5, 0.5], dtype=D)
    x1 = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(4))
    said = []
    for x in (x0, x1):
        got, words = caught(lambda: tv.jacobian(_batched_products, x,
                                                process_group=one_rank_group))
        said += words
        torch.testing.assert_close(got, _reverse_rows(_batched_products, x), rtol=1e-12,
                                   atol=1e-12)
    assert len(said) == 1, said
    assert "computed under torch.vmap disagrees with the same product without vmap" in \
        said[0], said[0]
    assert "at x itself they agreed" in said[0], said[0]
    assert tv.jacobian(_batched_products, x1, process_group=one_rank_group,
                       shard=True).mode == "rev"
