"""GradientEdge outputs (``torch.autograd.graph.get_gradient_edge``), which torch's
``torch.autograd.grad`` and ``backward`` take in place of tensors: their grad_outputs are
checked against the metadata torch itself reads for them (the shape, dtype and device of the
edge's node at its input), in tv.grad, tv.backward, checked mode and tv.check_grad_outputs."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.graph import get_gradient_edge

import torch_vjp as tv
from torch_vjp import _drop_ins
from torch_vjp._errors import full_message


def _graph():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(4, 8)
    h1 = lin(torch.randn(5, 4, generator=g))
    return lin.weight, h1, h1.tanh()


def _checked_grad(*args, **kwargs):
    with tv.checked():
        return torch.autograd.grad(*args, **kwargs)


@pytest.mark.parametrize("grad", [tv.grad, _checked_grad], ids=["tv.grad", "checked"])
def test_a_wrong_shape_for_the_second_edge_names_it(grad):
    # torch 2.13 reports an unrelated broadcasting error there, which leaked for edges
    w, h1, h2 = _graph()
    edges = [get_gradient_edge(h1), get_gradient_edge(h2)]
    with pytest.raises(tv.GradOutputsError) as info:
        grad(edges, w, [torch.ones(5, 8), torch.ones(5, 3)], retain_graph=True)
    assert str(info.value).startswith(
        "Mismatch in shape: grad_output[1] has a shape of torch.Size([5, 3]) and output[1] "
        "has a shape of torch.Size([5, 8]).")
    assert "grad_outputs[1] has shape (5, 3), but outputs[1] has shape (5, 8)" in full_message(
        info.value)


@pytest.mark.parametrize("grad", [tv.grad, _checked_grad], ids=["tv.grad", "checked"])
def test_edges_give_torch_s_results(grad):
    w, h1, h2 = _graph()
    edges = [get_gradient_edge(h1), get_gradient_edge(h2)]
    vectors = [torch.ones(5, 8), torch.full((5, 8), 0.5)]
    expected = torch.autograd.grad(edges, w, vectors, retain_graph=True)
    torch.testing.assert_close(grad(edges, w, vectors, retain_graph=True), expected)
    loss = h2.sum()  # a scalar edge: None stands for 1, as torch makes it
    expected = torch.autograd.grad(get_gradient_edge(loss), w, retain_graph=True)
    torch.testing.assert_close(grad(get_gradient_edge(loss), w, retain_graph=True), expected)


def test_backward_with_edges_is_checked():
    w, h1, h2 = _graph()
    with tv.checked(), pytest.raises(tv.GradOutputsError) as info:
        torch.autograd.backward([get_gradient_edge(h1), get_gradient_edge(h2)],
                                [torch.ones(5, 8), torch.ones(8)], inputs=[w])
    assert "grad_tensors[1] has shape (8,), but tensors[1] has shape (5, 8)" in full_message(
        info.value)
    expected = torch.autograd.grad(h2, w, torch.ones(5, 8), retain_graph=True)[0]
    tv.backward(get_gradient_edge(h2), torch.ones(5, 8), inputs=[w])
    torch.testing.assert_close(w.grad, expected)


def test_a_complex_vector_for_a_real_edge_is_rejected():
    w, _, h2 = _graph()
    with pytest.raises(tv.GradOutputsError, match="^For complex Tensors"):
        tv.grad(get_gradient_edge(h2), w, torch.ones(5, 8, dtype=torch.complex64))


def test_edges_whose_metadata_is_unknown_go_to_torch(monkeypatch):
    monkeypatch.setattr(_drop_ins, "_edge_stand_in", lambda edge: None)
    w, h1, h2 = _graph()
    edges = [get_gradient_edge(h1), get_gradient_edge(h2)]
    with pytest.raises(RuntimeError) as info:
        tv.grad(edges, w, [torch.ones(5, 8), torch.ones(5, 3)])
    assert not isinstance(info.value, tv.TorchVJPError)  # torch's own error, as before


def test_check_grad_outputs_takes_edges():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    (v,) = tv.check_grad_outputs(get_gradient_edge(y), torch.ones(3))
    assert torch.equal(v, torch.ones(3))
    (one,) = tv.check_grad_outputs(get_gradient_edge(y.sum()), None)
    assert torch.equal(one, torch.tensor(1.0))
    with pytest.raises(tv.GradOutputsError, match=r"^Mismatch in shape: grad_output\[0\]"):
        tv.check_grad_outputs(get_gradient_edge(y), torch.ones(4))


@pytest.mark.parametrize("other", [3.0, None], ids=["float", "None"])
def test_check_grad_outputs_rejects_an_output_that_is_no_tensor(other):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(tv.GradOutputsTypeError) as info:
        tv.check_grad_outputs([x * 2, other], [torch.ones(3), None])
    name = "a float" if other is not None else "None"
    fix = ("pass the tensor itself (.item() gives a number, which holds no graph)"
           if other is not None else
           "leave outputs[1] out of outputs, and its entry out of grad_outputs: None holds "
           "nothing to differentiate")
    assert str(info.value) == (
        f"torch_vjp.check_grad_outputs: outputs[1] is {name}, but each entry of outputs must "
        f"be a tensor (or a GradientEdge of one).\n"
        f"  outputs are the outputs y whose vector-Jacobian product is taken, tensors "
        f"computed from ones that require grad. Fix: {fix}.")
    assert isinstance(info.value, TypeError)


def _checked_backward(*args, **kwargs):
    with tv.checked():
        return torch.autograd.backward(*args, **kwargs)


def _edge_call(call, vector, op_log):
    x = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    y = (x * 3.0).sum() if vector is None else x * 3.0
    edge = get_gradient_edge(y)
    with op_log() as log:
        out = call(edge, x, vector)
    return log.ops, out, x


@pytest.mark.parametrize("vector", [None, "given"], ids=["implicit", "given"])
@pytest.mark.parametrize("kind", ["grad", "backward"])
@pytest.mark.parametrize("checked", [False, True], ids=["drop-in", "checked"])
def test_edges_show_a_dispatch_mode_only_torch_s_own_ops(kind, checked, vector, op_log):
    # The checker's stand-in for an edge (and its implicit ones) ran under the caller's
    # TorchDispatchMode: it logged aten.empty_strided and aten.ones_like that torch's own
    # call never runs (and a FakeTensorMode rejected the real stand-in).
    vec = None if vector is None else torch.ones(3, dtype=torch.float64)
    if kind == "grad":
        ours = _checked_grad if checked else tv.grad
        ref, mine = (lambda e, x, v, f=f: f(e, x, v) for f in (torch.autograd.grad, ours))
    else:
        ours = _checked_backward if checked else tv.backward
        ref, mine = (lambda e, x, v, f=f: f(e, v, inputs=x) for f in (torch.autograd.backward,
                                                                        ours))
    ref_ops, ref_out, ref_x = _edge_call(ref, vec, op_log)
    ops, out, x = _edge_call(mine, vec, op_log)
    assert ops == ref_ops
    if kind == "grad":
        torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
        torch.testing.assert_close(out[0], torch.full((3,), 3.0, dtype=torch.float64))
    else:
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, torch.full((3,), 3.0, dtype=torch.float64))


@pytest.mark.parametrize("grad", [tv.grad, _checked_grad], ids=["tv.grad", "checked"])
def test_an_edge_under_fake_tensor_mode_works_as_in_torch(grad):
    with FakeTensorMode():
        x = torch.randn(3, requires_grad=True)
        edge = get_gradient_edge((x * 2.0).sum())
        (g,) = grad(edge, x)
        assert isinstance(g, FakeTensor) and g.shape == (3,)
