"""``compile=True``: what a steady call (one that runs its entry's compiled program) does
around the program, and that the first call traces as the key assumes (one shape per
entry), each result checked in float64 against torch.func."""

from __future__ import annotations

import pytest
import torch

import torch_vjp as tv

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest

_STATIC = ("assume_static_by_default", "automatic_dynamic_shapes")


class _CountedVar:
    """A dynamo setting's override, with its writes counted."""

    def __init__(self, var):
        self.var = var
        self.sets = 0

    def get(self, *a):
        return self.var.get(*a)

    def set(self, value):
        self.sets += 1
        return self.var.set(value)


def test_a_steady_call_sets_no_dynamo_setting(monkeypatch):
    # NOTE [static shapes, once]: the first call traces with static shapes; later calls,
    # whose traces the sealed backend refuses, pay no patch of dynamo's config
    w = torch.randn(4, 3, dtype=D)
    x = torch.randn(3, dtype=D)

    def f(x):
        return torch.tanh(w @ x)

    ref = torch.func.jacrev(f)(x)
    for _ in range(2):  # (the first call, then one that runs the program)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), ref)
    entries = torch._dynamo.config._config
    counted = {}
    for name in _STATIC:
        counted[name] = _CountedVar(entries[name].user_override)
        monkeypatch.setattr(entries[name], "user_override", counted[name])
    for _ in range(3):
        torch.testing.assert_close(tv.jacobian(f, x, compile=True), ref)
    assert {name: c.sets for name, c in counted.items()} == {name: 0 for name in _STATIC}


def test_the_first_call_traces_static_shapes_where_the_user_made_them_dynamic(monkeypatch):
    # (with dynamo told to assume dynamic shapes, the program is still traced for the first
    # call's shapes: the key holds them, and every other shape is another entry)
    from torch_vjp._engine import compile_checks

    seen = []
    backend = compile_checks.GraphPrecision.__call__

    def noted(self, gm, example_inputs):
        seen.append([s for t in example_inputs if isinstance(t, torch.Tensor)
                     for s in t.shape])
        return backend(self, gm, example_inputs)

    monkeypatch.setattr(compile_checks.GraphPrecision, "__call__", noted)
    w = torch.randn(5, 5, dtype=D)

    def f(x):
        return torch.sin(w[: x.shape[0], : x.shape[0]] @ x) * x.shape[0]

    with torch._dynamo.config.patch(assume_static_by_default=False,
                                    automatic_dynamic_shapes=True):
        for n in (3, 3, 3, 4, 4, 4, 3):
            x = torch.randn(n, dtype=D)
            torch.testing.assert_close(tv.jacobian(f, x, compile=True),
                                       torch.func.jacrev(f)(x))
        assert torch._dynamo.config.assume_static_by_default is False  # (the user's, kept)
    assert len(seen) == 2  # (one program per shape, each built once)
    assert all(type(s) is int for sizes in seen for s in sizes)
