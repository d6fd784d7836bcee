"""jacobian_of on graphs with tensors that retain their gradient (``Tensor.retain_grad()``)
inside them, not only at the outputs and inputs: the Jacobian against torch.func.jacrev in
float64, and every ``.grad`` as it was (NOTE [retain_grad inside the graph])."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

OPTIONS = [
    pytest.param({}, id="one-chunk"),
    pytest.param({"chunk_size": 1}, id="loop"),
    pytest.param({"chunk_size": 2}, id="chunks-of-2"),
    pytest.param({"create_graph": True}, id="create_graph"),
]


def _f(x):
    return (x.sin() * 2).exp() * x.sqrt()


def _graph(x0):
    x = x0.clone().requires_grad_()
    h = x.sin()
    h.retain_grad()
    h2 = (h * 2).exp()
    h2.retain_grad()
    return x, h, h2, h2 * x.sqrt()


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("backward_first", [False, True], ids=["no-grad-yet", "grad-set"])
def test_jacobian_of_with_intermediates_retaining_grad(options, backward_first):
    x0 = torch.rand(5, dtype=torch.float64) + 0.1
    expected = torch.func.jacrev(_f)(x0)
    x, h, h2, y = _graph(x0)
    if backward_first:
        y.sum().backward(retain_graph=True)
    before = [None if t.grad is None else t.grad.clone() for t in (h, h2)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        J = tv.jacobian_of(y, x, retain_graph=True, **options)
        J_again = tv.jacobian_of(y, x, retain_graph=True, **options)  # the graph is whole
    torch.testing.assert_close(J, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(J_again, expected, rtol=1e-12, atol=1e-12)
    for t, b in zip((h, h2), before):
        if b is None:
            assert t.grad is None
        else:
            assert torch.equal(t.grad, b)
            assert not torch._C._functorch.is_batchedtensor(t.grad)
    # the user's own backward pass afterwards works, and adds as it would have
    y.sum().backward()
    x_ref, h_ref, h2_ref, y_ref = _graph(x0)
    if backward_first:
        y_ref.sum().backward(retain_graph=True)
    y_ref.sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(h2.grad, h2_ref.grad, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def test_retaining_intermediate_whose_python_object_is_gone():
    # h is saved by the graph (h * h) and retains its gradient; the user dropped h itself
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    h = x.sin()
    h.retain_grad()
    y = h * h
    del h
    J = tv.jacobian_of(y, x, retain_graph=True, chunk_size=2)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.sin() ** 2)(x.detach()))
    y.sum().backward()  # (no batched tensor left in the saved h's .grad)
    torch.testing.assert_close(x.grad, torch.func.grad(lambda v: (v.sin() ** 2).sum())(
        x.detach()))


def test_retaining_intermediate_with_several_outputs_and_inputs():
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    m = torch.outer(a, b)
    m.retain_grad()
    outs = (m.tanh().sum(1), (m * 3).sum())
    J = tv.jacobian_of(outs, (a, b), retain_graph=True)
    expected = torch.func.jacrev(lambda a, b: (torch.outer(a, b).tanh().sum(1),
                                               (torch.outer(a, b) * 3).sum()),
                                 argnums=(0, 1))(a.detach(), b.detach())
    torch.testing.assert_close(J, expected)
    assert m.grad is None


def _retains_inside(x):
    h = x.sin()
    if h.requires_grad:  # (forward mode's tensors do not require grad)
        h.retain_grad()
    return h * x


def test_a_function_calling_retain_grad_is_explained_or_computed():
    # torch.func refuses Tensor.retain_grad() inside the function it transforms; the
    # vectorised reverse strategy let torch's bare RuntimeError through, unexplained
    x = torch.randn(4, dtype=torch.float64)
    expected = torch.func.jacrev(lambda v: v.sin() * v)(x)
    with pytest.raises(tv.StrategyError, match=(
            r"(?s)^torch_vjp\.jacobian: the vectorised strategies compute with torch\.func, "
            r"which cannot run f \(_retains_inside\) in rev-mode products: f runs plain "
            r"autograd itself \(.*\.retain_grad\(\).*\)\, which torch\.func's transforms "
            r"refuse .*torch\.func said: RuntimeError: You are attempting to call "
            r"Tensor\.retain_grad\(\).*Fix: strategy='auto', 'rev-loop' or 'fwd-loop'")):
        tv.jacobian(_retains_inside, x, strategy="rev")
    for strategy in ("auto", "fwd", "rev-loop", "fwd-loop"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            torch.testing.assert_close(tv.jacobian(_retains_inside, x, strategy=strategy),
                                       expected)


class _Passes(torch.autograd.Function):
    """The identity, counting the backward passes through it: vectorised (its gradient a
    batched tensor, under torch.vmap; ``rows``: the rows of each) and not."""

    vectorised = 0
    plain = 0
    rows: list[int] = []

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        if torch._C._functorch.is_batchedtensor(g):
            _Passes.vectorised += 1
            bdim = torch._C._functorch.maybe_get_bdim(g)
            _Passes.rows.append(torch._C._functorch.get_unwrapped(g).shape[bdim])
        else:
            _Passes.plain += 1
        return g


@pytest.mark.parametrize("retaining", [False, True], ids=["none-retains", "one-retains"])
@pytest.mark.parametrize("chunk_size,vectorised", [(None, 1), (2, 3)], ids=["one-chunk", "3-chunks"])
def test_finding_retaining_tensors_costs_no_vectorised_pass_of_its_own(
        retaining, chunk_size, vectorised):
    # the tensors inside the graph that retain their gradient are found by one pass without
    # vmap (which stops at the first retaining tensor, before its node runs), where a
    # vectorised pass of their own with a zero cotangent made every call cost 1.5 times as
    # much (NOTE [retain_grad inside the graph])
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    h = _Passes.apply(x.sin())
    if retaining:
        h.retain_grad()
    y = h * x
    tv.jacobian_of(y, x, retain_graph=True, chunk_size=chunk_size)  # (the check, once)
    _Passes.vectorised = _Passes.plain = 0
    J = tv.jacobian_of(y, x, retain_graph=True, chunk_size=chunk_size)
    assert (_Passes.vectorised, _Passes.plain) == (vectorised, 0 if retaining else 1)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.sin() * v)(x.detach()),
                               rtol=1e-12, atol=1e-12)
    if retaining:
        assert h.grad is None


def test_a_grad_keeps_its_value_and_object_under_create_graph():
    # a .grad set before comes back as it was, the very object, and the Jacobian is right
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    h = x.exp()
    h.retain_grad()
    y = (h * h).cumsum(0)
    y.sum().backward(retain_graph=True)
    G = h.grad
    before = G.clone()
    J = tv.jacobian_of(y, x, retain_graph=True, create_graph=True)
    assert h.grad is G
    assert J.shape == (5, 5) and J.requires_grad
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: (v.exp() ** 2).cumsum(0))(
        x.detach()), rtol=1e-12, atol=1e-12)
    assert torch.equal(h.grad, before) and not h.grad.requires_grad


class _NoVmap(torch.autograd.Function):
    """The identity, whose backward reads a number out of its gradient: torch.vmap cannot
    batch it, so jacobian_of's products fall back to the loop."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        g.sum().item()
        return g


@pytest.mark.parametrize("options", OPTIONS[:3])
@pytest.mark.parametrize("backward_first", [False, True], ids=["no-grad-yet", "grad-set"])
def test_retaining_tensor_past_a_pass_vmap_cannot_batch(options, backward_first):
    # the vectorised pass fails at _NoVmap's backward, before it reaches h's hook: h was not
    # found, and the loop that replaced the pass added every row into h.grad
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    h = x.sin()
    h.retain_grad()
    y = _NoVmap.apply(h) * x
    if backward_first:
        y.sum().backward(retain_graph=True)
    before = h.grad
    copy = None if before is None else before.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = tv.jacobian_of(y, x, retain_graph=True, **options)
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.sin() * v)(x.detach()),
                               rtol=1e-12, atol=1e-12)
    assert h.grad is before  # (its .grad untouched: the very object)
    if copy is not None:
        assert torch.equal(h.grad, copy)


class _Raises(torch.autograd.Function):
    """The identity, whose backward raises an error of the user's own, with vmap or not."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        raise ValueError("the user's backward failed")


@pytest.mark.parametrize("options", OPTIONS[:3])
@pytest.mark.parametrize("grad_before", [None, 1.0, 0.0], ids=["no-grad", "grad-ones",
                                                                "grad-zeros"])
def test_a_backward_of_the_users_that_raises_leaves_every_grad_as_it_was(
        options, grad_before):
    # the error passes through untouched, and the .grad of the tensors that retain theirs
    # comes back as it was, the very object (all zeros too)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    h_in = x.sin()
    h_in.retain_grad()
    h_out = _Raises.apply(h_in).exp()
    h_out.retain_grad()
    y = h_out * x
    if grad_before is not None:
        h_in.grad = torch.full((5,), 2.0, dtype=torch.float64)
        h_out.grad = torch.full((5,), grad_before, dtype=torch.float64)
    before = [h_in.grad, h_out.grad]
    copies = [None if g is None else g.clone() for g in before]
    with pytest.raises(ValueError, match=r"^the user's backward failed$"):
        tv.jacobian_of(y, x, retain_graph=True, **options)
    for t, g, copy in zip((h_in, h_out), before, copies):
        assert t.grad is g
        if copy is not None:
            assert torch.equal(t.grad, copy)


@pytest.mark.parametrize("fit", [2, 3, 4, 6])
@pytest.mark.parametrize("retaining", [False, True], ids=["none-retains", "one-retains"])
def test_the_products_stay_within_the_memory_budget(monkeypatch, fit, retaining):
    # a budget with room for `fit` products at once (NOTE [memory model]): no pass of more
    # rows, and no result storage beyond the budget the plan had checked (a zero row put
    # before the first chunk's once made a pass of fit + 1 rows)
    from torch_vjp._engine import memory

    n = 4
    itemsize, jac_bytes = 8, 8 * n * n
    per_product = memory.WORK_FACTOR * itemsize * (n + n)
    budget = jac_bytes + fit * per_product
    monkeypatch.setattr(memory, "SMALL_REQUEST", 0)
    monkeypatch.setattr(memory, "free_memory", lambda device: (budget, "set by the test"))
    x = torch.randn(n, dtype=torch.float64, requires_grad=True)
    h = _Passes.apply(x.sin())
    if retaining:
        h.retain_grad()
    y = h * x.exp()
    _Passes.rows = []
    J = tv.jacobian_of(y, x, retain_graph=True)
    assert _Passes.rows and max(_Passes.rows) <= fit, _Passes.rows
    assert J.untyped_storage().nbytes() <= budget
    if fit < n:
        assert J.untyped_storage().nbytes() == jac_bytes
    torch.testing.assert_close(J, torch.func.jacrev(lambda v: v.sin() * v.exp())(x.detach()),
                               rtol=1e-12, atol=1e-12)
    if retaining:
        assert h.grad is None
