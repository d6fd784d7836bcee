"""jacobian_of leaves nothing on the user's graph: no entry in any node's ``metadata`` (the
probe for tensors that retain their gradient inside the graph, NOTE [retain_grad inside the
graph] in torch_vjp/_engine/retained.py, watches one backward pass instead of hooking the
nodes' tensors), while every ``.grad`` stays the very object it was, in every way a
retaining tensor can sit in the graph. float64, against torch.func.jacrev."""
import threading

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine.graph import graph_nodes

D = torch.float64


def _f(v):
    return (v.cos() * 3).exp() * v


def _ref(x):
    return torch.func.jacrev(_f)(x.detach())


def _metadata(outs):
    return [dict(n.metadata) for n in graph_nodes(outs) if n.metadata]


@pytest.mark.parametrize("options", [{}, {"chunk_size": 1}, {"create_graph": True}],
                         ids=["one-chunk", "loop", "create-graph"])
@pytest.mark.parametrize("retaining", [False, True])
def test_no_metadata_is_left_on_the_graph(options, retaining):
    x = torch.randn(4, dtype=D, requires_grad=True)
    h = x.cos()
    if retaining:
        h.retain_grad()
    y = (h * 3).exp() * x
    for _ in range(2):
        J = tv.jacobian_of(y, x, retain_graph=True, **options)
        torch.testing.assert_close(J, _ref(x), rtol=1e-12, atol=1e-12)
        assert _metadata([y]) == []
    if retaining:
        assert h.grad is None
    # the user's own backward afterwards runs as before
    y.sum().backward()
    torch.testing.assert_close(x.grad, _ref(x).sum(0), rtol=1e-12, atol=1e-12)
    if retaining:
        torch.testing.assert_close(h.grad, torch.func.grad(
            lambda c: ((c * 3).exp() * x.detach()).sum())(x.detach().cos()),
            rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grad", ["none", "values"])
@pytest.mark.parametrize("where", ["inside", "output", "input", "all"])
def test_retaining_tensors_anywhere_keep_their_grad(grad, where):
    x0 = torch.randn(4, dtype=D, requires_grad=True)
    x = x0 * 1  # (a non-leaf input, whose retain_grad hook runs for autograd.grad)
    h = x.cos()
    y = (h * 3).exp() * x
    chosen = {"inside": [h], "output": [y], "input": [x], "all": [h, y, x]}[where]
    before = {}
    for t in chosen:
        t.retain_grad()
        t.grad = None if grad == "none" else torch.full((4,), 2.5, dtype=D)
        before[id(t)] = (t.grad, None if t.grad is None else t.grad.clone())
    J = tv.jacobian_of(y, x, retain_graph=True)
    torch.testing.assert_close(J, _ref(x), rtol=1e-12, atol=1e-12)
    for t in chosen:
        obj, values = before[id(t)]
        assert t.grad is obj
        if values is not None:
            assert torch.equal(t.grad, values)
    assert _metadata([y]) == []


def test_a_hook_of_the_users_that_clones_runs_and_grads_stay():
    # (a hook computing outside every node: the probe stops at it and looks the retaining
    # tensors up instead, which is slower, never wrong)
    x = torch.randn(4, dtype=D, requires_grad=True)
    h = x.cos()
    h.retain_grad()
    h.register_hook(lambda g: g.clone() * 2)
    y = (h * 3).exp() * x
    J = tv.jacobian_of(y, x, retain_graph=True)
    ref = torch.func.jacrev(lambda v: (v.cos() * 3).exp() * v)(x.detach())
    direct = torch.diag((x.detach().cos() * 3).exp())
    torch.testing.assert_close(J, 2 * ref - direct, rtol=1e-12, atol=1e-12)
    assert h.grad is None and _metadata([y]) == []


def test_threads_on_one_graph_leave_every_grad_alone():
    x = torch.randn(5, dtype=D, requires_grad=True)
    h = x.cos()
    h.retain_grad()
    held = torch.ones(5, dtype=D)
    h.grad = held
    y = (h * 3).exp() * x
    results, errors = [], []

    def run():
        try:
            for _ in range(5):
                results.append(tv.jacobian_of(y, x, retain_graph=True))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for J in results:
        torch.testing.assert_close(J, _ref(x), rtol=1e-12, atol=1e-12)
    assert h.grad is held and torch.equal(held, torch.ones(5, dtype=D))
    assert _metadata([y]) == []
