"""Sharded strategy="auto" at a degenerate first point (NOTE [auto, checked near the point]
in torch_vjp._engine.nearcheck): where the modes agree at x and disagree near it, the
sharded check takes forward mode like one process, and its warning gives the numbers near
x, where they disagree (it gave those at x, which agree). float64, a one-rank gloo group."""

from __future__ import annotations

import re

import pytest
import torch

import torch_vjp as tv

from _references import WrongBackward, caught, jvp_columns

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


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
