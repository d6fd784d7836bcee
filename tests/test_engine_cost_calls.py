"""What a Jacobian call does per call that it need not: no walk of tensor primals for
modules, no context entered for a process group that is not there, one name lookup per
node type in the walk for wrong operators; each with the same answers as before."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._engine import context, wrongops

D = torch.float64


def test_tensor_primals_are_not_walked_for_modules(monkeypatch):
    w = torch.randn(3, 3, dtype=D)
    calls = []
    walk = context.reached
    monkeypatch.setattr(context, "reached", lambda f, *a: calls.append(f) or walk(f, *a))
    x = torch.randn(3, dtype=D)
    J = tv.jacobian(lambda x, y: w @ x + y, x, x.clone(), strategy="rev")
    torch.testing.assert_close(J, w)
    assert all(not isinstance(f, tuple) for f in calls)


def test_a_module_among_the_primals_still_has_its_buffers_put_back():
    bn = torch.nn.BatchNorm1d(3).double()
    x = torch.randn(4, 3, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = tv.jacobian(lambda m, t: m(t), bn, x, argnums=1, strategy="auto")
    want = torch.func.jacrev(lambda t: F.batch_norm(t, None, None, bn.weight, bn.bias,
                                                    training=True))(x)
    torch.testing.assert_close(J, want)
    assert bn.num_batches_tracked.item() == 0
    assert torch.equal(bn.running_mean, torch.zeros(3, dtype=D))


def test_no_failure_context_without_a_process_group(monkeypatch):
    import torch_vjp.jacobians as jacobians

    entered = []
    told = jacobians.told_on_failure
    monkeypatch.setattr(jacobians, "told_on_failure",
                        lambda group: entered.append(group) or told(group))
    x = torch.randn(3, dtype=D)
    tv.jacobian(torch.sin, x, strategy="fwd")
    tv.batch_jacobian(torch.sin, x[None], strategy="rev")
    assert entered == []


def _graphs():
    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    y = torch.randn(5, 3, dtype=D)
    base = torch.randn(8, dtype=D, requires_grad=True)
    img = torch.randn(1, 1, 6, 1, dtype=D, requires_grad=True)
    yield [torch.tanh(x @ x.T).sum(0)]
    yield [torch.cdist(x, y)]
    yield [torch.as_strided_scatter(base * 2, torch.ones(2, dtype=D), (2,), (1,))]
    yield [F.interpolate(img, size=(3, 1), mode="bilinear", antialias=True)]
    yield [F.interpolate(img, size=(3, 2), mode="bilinear", antialias=True)]
    yield [torch.cdist(x, y), torch.as_strided_scatter(base, torch.ones(2, dtype=D) * x[0, 0],
                                                      (2,), (1,))]
    yield [x.detach()]


@pytest.mark.parametrize("outs", list(_graphs()))
def test_the_walk_for_wrong_operators_finds_what_the_tables_name(outs):
    # (torch's own tables passed explicitly take the general walk over graph_nodes)
    want = wrongops.wrong_ops(outs, wrongops._BATCHED_WRONGLY, wrongops._WRONG_ALONE)
    assert wrongops.wrong_ops(outs) == want
    assert wrongops._NODE_NAMES  # (each node type's name, read once)


def test_the_known_wrong_operators_are_found():
    x = torch.randn(4, 3, dtype=D, requires_grad=True)
    y = torch.randn(5, 3, dtype=D)
    base = torch.randn(8, dtype=D, requires_grad=True)
    assert wrongops.wrong_ops([torch.cdist(x, y)])[0] is not None
    assert wrongops.wrong_ops([torch.as_strided_scatter(base * 2, torch.ones(2, dtype=D),
                                                        (2,), (1,))])[1] is not None
    assert wrongops.wrong_ops([torch.tanh(x).sum()]) == (None, None)
