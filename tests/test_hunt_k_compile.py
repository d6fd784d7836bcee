"""``compile=True``: later calls whose state differs from the first call's in ways the cache
key or the noted key of a function called again must tell apart, each checked in float64
against torch.func at that moment."""

from __future__ import annotations

import math

import pytest
import torch

import torch_vjp as tv

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py


def test_a_zero_of_the_other_sign_is_another_number():
    # (0.0 == -0.0, but a program traced for one bakes its sign in: copysign, 1 / s)
    x = torch.randn(3, dtype=D)
    s = 0.0

    def f(x):
        return x.sin() * math.copysign(1.0, s)

    def g(x, t):
        return x.sin() * math.copysign(1.0, t)

    for value in (0.0, 0.0, 0.0, -0.0, -0.0, 0.0):
        s = value  # (the same function, its closure rebound: the noted key)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), torch.func.jacrev(f)(x))
        # (a new function each call: the full key; and the value as an argument)
        h = lambda x, s=value: x.sin() * math.copysign(1.0, s)  # noqa: E731
        torch.testing.assert_close(tv.jacobian(h, x, compile=True), torch.func.jacrev(h)(x))
        torch.testing.assert_close(tv.jacobian(g, x, value, compile=True),
                                   torch.func.jacrev(g)(x, value))
        c = complex(1.0, value)
        k = lambda x, c=c: x.sin() * math.copysign(1.0, c.imag)  # noqa: E731
        torch.testing.assert_close(tv.jacobian(k, x, compile=True), torch.func.jacrev(k)(x))
