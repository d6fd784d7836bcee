"""Sharded strategy="auto" at a degenerate first point (NOTE [auto, checked near the point]
in torch_vjp._engine.nearcheck): where the modes agree at x and disagree near it, the
sharded check takes forward mode like one process, and its warning gives the numbers near
x, where they disagree (it gave those at x, which agree). float64, a one-rank gloo group."""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist

import torch_vjp as tv

from _references import caught, jvp_columns

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


class _WrongBackward(torch.autograd.Function):
    """2 x, whose backward is wrong (3 g); its jvp is right."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 3

    @staticmethod
    def jvp(ctx, t):
        return t * 2


def _products(u):
    return _WrongBackward.apply(u[1:] * u[:-1]).sin()


@pytest.fixture
def group():
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}",
                                rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def test_sharded_auto_at_zeros_takes_forward_mode_and_says_the_numbers_near_x(group):
    x1 = torch.randn(8, dtype=D, generator=torch.Generator().manual_seed(4))
    said = []
    for x in (torch.zeros(8, dtype=D), x1):
        got, words = caught(lambda: tv.jacobian(_products, x, process_group=group))
        said += words
        torch.testing.assert_close(got, jvp_columns(_products, x))
    assert len(said) == 1
    assert "at a point near x" in said[0]
    # the numbers said are those near x, where the two products disagree
    m = re.search(r"u\^T J v: (\S+) by reverse mode, (\S+) by forward mode", said[0])
    assert m is not None and abs(float(m[1]) - float(m[2])) > 0.1, said[0]
