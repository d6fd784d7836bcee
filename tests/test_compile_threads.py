"""A call in one thread while another thread is inside ``torch.compile``.

``torch.compiler.is_compiling()`` is a process-wide flag, True in every thread for the whole
of any thread's compile: read alone, it made a plain eager call here behave as a call traced
by dynamo. Each such place reads the per-thread test (``tracing()``) instead; inside a real
trace (the user's own ``torch.compile``) the behaviour stays as it was. Every result is
compared in float64 with an independent reference."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "aot_eager_unless_inductor")  # conftest


@pytest.fixture
def other_thread_compiling():
    """Another thread held inside a torch.compile session (its backend waits), so that
    ``torch.compiler.is_compiling()`` is True here too, for the whole test."""
    started, release = threading.Event(), threading.Event()

    def backend(gm, example_inputs):
        started.set()
        release.wait(120)
        return gm.forward

    def other():
        torch.compile(lambda t: t * 2, backend=backend, fullgraph=True)(torch.ones(2))

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert started.wait(120)
        assert torch.compiler.is_compiling()  # (the other thread's flag, seen here)
        yield
    finally:
        release.set()
        thread.join()


def test_a_call_while_another_thread_compiles_runs_the_eager_path(other_thread_compiling):
    # (a call here is no call inside dynamo's trace, and keeps the eager path's copies and
    # buffers_kept)
    x = torch.randn(3, dtype=D)
    x0 = x.clone()

    def f(x):
        x.mul_(2)  # (into the eager path's copy, never the caller's tensor)
        return x.sin()

    for compile in (False, True):
        got = tv.jacobian(f, x, compile=compile)
        assert torch.equal(x, x0)
        torch.testing.assert_close(got, torch.func.jacrev(lambda x: f(x.clone()))(x0))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(D)
    xb = torch.randn(5, 3, dtype=D)
    stats = model[1].running_mean.clone()
    got = tv.jacobian(model, xb)  # (training mode: its statistics put back)
    assert torch.equal(model[1].running_mean, stats)
    model[1].track_running_stats = False
    torch.testing.assert_close(got, torch.func.jacrev(model)(xb))


def _loop_grads(model, loss_fn, x, y):
    out = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        for (n, _), g in zip(model.named_parameters(), grads):
            out[n].append(g)
    return {n: torch.stack(gs) for n, gs in out.items()}


def _mse(out, y):
    return ((out - y) ** 2).sum()


# --------------------------------------------------------------------------------------
# per-sample gradients
# --------------------------------------------------------------------------------------

def test_per_sample_in_inference_mode_is_refused_while_another_thread_compiles(
        other_thread_compiling):
    model = torch.nn.Linear(3, 2).to(D)
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)
    with torch.inference_mode(), pytest.raises(
            tv.PerSampleError, match=r"^torch_vjp\.per_sample_grads: called inside "
                                     r"torch\.inference_mode\(\)"):
        tv.per_sample_grads(model, _mse, x, y)


def test_per_sample_plan_sees_a_hook_registered_while_another_thread_compiles(
        other_thread_compiling):
    # (the plan's key holds the model's structure, its hooks included: a plan made while
    # another thread compiled must not be found again once a hook changes the output)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                torch.nn.Linear(4, 2)).to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.randn(5, 2, dtype=D)
    for strategy in ("hooks", "auto"):
        got = tv.per_sample_grads(model, _mse, x, y, strategy=strategy)
        torch.testing.assert_close(got, _loop_grads(model, _mse, x, y))
    handle = model[1].register_forward_hook(lambda m, a, out: out * 3)
    try:
        for strategy in ("hooks", "auto"):
            got = tv.per_sample_grads(model, _mse, x, y, strategy=strategy)
            torch.testing.assert_close(got, _loop_grads(model, _mse, x, y))
    finally:
        handle.remove()


def test_per_sample_inside_the_users_compile_is_unchanged():
    model = torch.nn.Linear(3, 2).to(D)
    x, y = torch.randn(4, 3, dtype=D), torch.randn(4, 2, dtype=D)

    def step(x, y):
        return tv.per_sample_grads(model, _mse, x, y, strategy="vmap")

    got = torch.compile(step, fullgraph=True, backend="eager")(x, y)
    torch.testing.assert_close(got, _loop_grads(model, _mse, x, y))


# --------------------------------------------------------------------------------------
# checked mode
# --------------------------------------------------------------------------------------

def test_checked_mode_checks_while_another_thread_compiles(other_thread_compiling):
    x = torch.randn(3, dtype=D, requires_grad=True)
    y = torch.outer(x, x)
    with tv.checked(), pytest.raises(
            tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(3,\), but "
                                       r"outputs\[0\] has shape \(3, 3\)"):
        torch.autograd.grad(y, x, torch.ones(3, dtype=D))


def test_checked_mode_inside_the_users_compile_is_unchanged():
    def f(x):
        y = (x.sin() * x).sum()
        return torch.autograd.grad(y, x, create_graph=True)[0]

    x = torch.randn(3, dtype=D, requires_grad=True)
    with tv.checked():
        got = torch.compile(f, backend="eager")(x)
    torch.testing.assert_close(got, x.cos() * x + x.sin())


def test_disconnected_block_is_warned_while_another_thread_compiles(other_thread_compiling):
    x = torch.tensor([1.0, 2.0], dtype=D)
    f = lambda x: torch.tensor([x.sum().item()] * 2, dtype=D)  # noqa: E731
    with tv.checked(), pytest.warns(
            tv.JacobianWarning, match=r"^torch_vjp\.jacobian: the output of f does not "
                                      r"depend on primals\[0\] through autograd"):
        got = tv.jacobian(f, x, strategy="rev")
    assert torch.equal(got, torch.zeros(2, 2, dtype=D))


def test_jacobian_in_checked_mode_inside_the_users_compile_is_unchanged():
    def f(x):
        return tv.jacobian(lambda t: t.sin() * t, x)

    x = torch.randn(3, dtype=D)
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        got = torch.compile(f, fullgraph=True, backend="eager")(x)
    torch.testing.assert_close(got, torch.func.jacrev(lambda t: t.sin() * t)(x))


# --------------------------------------------------------------------------------------
# the basis
# --------------------------------------------------------------------------------------

def test_basis_is_filled_eagerly_while_another_thread_compiles(other_thread_compiling,
                                                               monkeypatch):
    # (the comparison of two aranges is the form inductor fuses, for a traced program
    # only; a plain call fills the diagonal of zeros)
    from torch_vjp._engine.rows import basis_rows

    made = []
    arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: made.append(a) or arange(*a, **k))
    a, b = basis_rows([torch.Size([2]), torch.Size([])], [D] * 2,
                      [torch.device("cpu")] * 2)(1, 3)
    assert made == []
    assert a.tolist() == [[0.0, 1.0], [0.0, 0.0]] and b.tolist() == [0.0, 1.0]
