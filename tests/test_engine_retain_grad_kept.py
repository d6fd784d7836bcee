"""jacobian_of leaves the ``.grad`` of every tensor of the graph exactly as it was: the
same object (a user or an optimizer holding it sees it still attached), the same values,
the same None-ness, an all-zero ``.grad`` and a ``.grad`` that is a non-contiguous view
included (NOTE [retain_grad inside the graph] in torch_vjp/_engine/retained.py). float64,
against torch.func.jacrev."""
import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _ref(x):
    return torch.func.jacrev(lambda v: (v.sin() * 3).exp() * v)(x.detach())


def _grads():
    base = torch.arange(12.0, dtype=D).reshape(3, 4)
    return {
        "none": None,
        "values": torch.full((3,), 2.5, dtype=D),
        "zeros": torch.zeros(3, dtype=D),
        "strided-view": base[:, 1],  # (a non-contiguous view of a bigger tensor)
        "expanded": torch.tensor(7.0, dtype=D).expand(3),
    }


@pytest.mark.parametrize("kind", list(_grads()))
@pytest.mark.parametrize("options", [{}, {"chunk_size": 1}, {"chunk_size": 2},
                                     {"create_graph": True}],
                         ids=["one-chunk", "loop", "chunks", "create-graph"])
def test_grads_inside_the_graph_are_the_very_objects(kind, options):
    x = torch.randn(3, dtype=D, requires_grad=True)
    h = x.sin()
    h.retain_grad()
    h2 = h * 3
    h2.retain_grad()
    y = h2.exp() * x
    y.retain_grad()
    grads = {t: _grads()[kind] for t in ("x", "h", "h2", "y")}
    for name, t in (("x", x), ("h", h), ("h2", h2), ("y", y)):
        t.grad = grads[name]
    copies = {k: None if g is None else g.clone() for k, g in grads.items()}
    versions = {k: None if g is None else g._version for k, g in grads.items()}
    J = tv.jacobian_of(y, x, retain_graph=True, **options)
    torch.testing.assert_close(J, _ref(x), rtol=1e-12, atol=1e-12)
    for name, t in (("x", x), ("h", h), ("h2", h2), ("y", y)):
        assert t.grad is grads[name], name
        if grads[name] is not None:
            assert torch.equal(t.grad, copies[name]) and t.grad._version == versions[name]


def test_a_grad_held_by_an_optimizer_stays_attached():
    # an optimizer steps with the .grad objects it sees; after jacobian_of, a later
    # backward still accumulates into that same object
    x = torch.randn(3, dtype=D, requires_grad=True)
    h = x.sin()
    h.retain_grad()
    y = h.exp() * x
    y.sum().backward(retain_graph=True)
    held = h.grad
    first = held.clone()
    tv.jacobian_of(y, x, retain_graph=True)
    assert h.grad is held
    y.sum().backward(retain_graph=True)
    # (retain_grad's hook adds out of place: the later sum is right whatever the object)
    torch.testing.assert_close(h.grad, 2 * first, rtol=1e-12, atol=1e-12)


def test_repeated_calls_leave_nothing_on_the_nodes_and_the_users_backward_runs_as_before():
    x = torch.randn(4, dtype=D, requires_grad=True)
    h = x.cos()
    h.retain_grad()
    y = h * x
    for _ in range(3):
        J = tv.jacobian_of(y, x, retain_graph=True)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.cos() * v)(x.detach()),
                               rtol=1e-12, atol=1e-12)
    assert not y.grad_fn.metadata and not h.grad_fn.metadata
    assert h.grad is None
    # the user's own backward afterwards runs as before
    y.sum().backward()
    torch.testing.assert_close(h.grad, x.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, torch.func.grad(lambda v: (v.cos() * v).sum())(
        x.detach()), rtol=1e-12, atol=1e-12)


class _NoVmap(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        g.sum().item()  # (vmap cannot batch .item(): the products take the loop)
        return g


@pytest.mark.parametrize("kind", ["none", "values", "zeros"])
def test_grads_kept_where_the_products_fall_back_to_the_loop(kind):
    x = torch.randn(4, dtype=D, requires_grad=True)
    h_in = x.sin()
    h_in.retain_grad()
    h_out = _NoVmap.apply(h_in).exp()
    h_out.retain_grad()
    y = h_out * x
    g = {"none": None, "values": torch.ones(4, dtype=D), "zeros": torch.zeros(4, dtype=D)}
    h_in.grad, h_out.grad = g[kind], None if g[kind] is None else g[kind].clone()
    before = (h_in.grad, h_out.grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian_of(y, x, retain_graph=True)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.sin().exp() * v)(x.detach()),
                               rtol=1e-12, atol=1e-12)
    assert h_in.grad is before[0] and h_out.grad is before[1]


@pytest.mark.parametrize("kind", ["none", "values"])
def test_a_sparse_tensor_retaining_its_gradient_inside_the_graph(kind):
    # (its gradient is sparse: the probe stops there as well, before its hook writes)
    x = torch.randn(3, dtype=D, requires_grad=True)
    h = (x * 2).to_sparse()
    h.retain_grad()
    G = None if kind == "none" else torch.ones(3, dtype=D).to_sparse()
    h.grad = G
    y = (h * 3).to_dense().sin()
    J = tv.jacobian_of(y, x, retain_graph=True)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: (v * 6).sin())(x.detach()),
                               rtol=1e-12, atol=1e-12)
    assert h.grad is G
