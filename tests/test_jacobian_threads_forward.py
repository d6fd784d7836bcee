"""Forward mode from several threads at once. torch's forward-mode AD keeps its dual level
and torch.func.jvp's nesting count in process-wide state, not per thread: two threads that
each computed forward products at the same time made their dual tensors in one level, and
the first to leave it took the other's tangents with it. tv.jacobian(strategy="fwd-loop"),
"fwd", tv.jvp, tv.batch_jacobian and tv.hessian then raised torch's "Trying to access a
forward AD level with an invalid index" or, silently, returned a wrong Jacobian (NOTE
[forward mode, one thread at a time] in torch_vjp/_engine/context.py)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _slow(a):
    # (a pause inside f, so that the threads' calls of f overlap)
    time.sleep(0.002)
    return (a.sin() * a.sum(0)).cumsum(-1)


def _rowwise(a):
    time.sleep(0.002)
    return (a.sin() * a.sum(-1, keepdim=True)).cumsum(-1)


def _points(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, dtype=D, generator=g) for _ in range(n)]


def _in_threads(work, points):
    results = [None] * len(points)

    def run(i):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                results[i] = work(points[i])
        except Exception as err:  # noqa: BLE001 - reported below, with its thread
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(points))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _hess_f(a):
    time.sleep(0.002)
    return (a.sin() * a.cumsum(0)).sum()


CALLS = {
    "jacobian-fwd": (lambda a: tv.jacobian(_slow, a, strategy="fwd"),
                     lambda a: torch.func.jacrev(_slow)(a)),
    "jacobian-fwd-chunk-2": (lambda a: tv.jacobian(_slow, a, strategy="fwd", chunk_size=2),
                             lambda a: torch.func.jacrev(_slow)(a)),
    "jacobian-fwd-loop": (lambda a: tv.jacobian(_slow, a, strategy="fwd-loop"),
                          lambda a: torch.func.jacrev(_slow)(a)),
    "jvp-batched-chunk-1": (
        lambda a: tv.jvp(_slow, (a,), (torch.eye(12, dtype=D).reshape(12, 3, 4),),
                         batched=True, chunk_size=1)[1],
        lambda a: torch.func.jacrev(_slow)(a).reshape(3, 4, 12).permute(2, 0, 1)),
    "batch-jacobian-fwd-loop": (
        lambda a: tv.batch_jacobian(_rowwise, a, strategy="fwd-loop"),
        lambda a: torch.stack([torch.func.jacrev(_rowwise)(r) for r in a])),
    "hessian-fwd-loop": (lambda a: tv.hessian(_hess_f, a[0], strategy="fwd-loop"),
                         lambda a: torch.func.hessian(_hess_f)(a[0])),
}


@pytest.mark.parametrize("call", CALLS, ids=list(CALLS))
def test_forward_mode_in_several_threads_gives_each_thread_its_jacobian(call):
    work, reference = CALLS[call]
    points = _points(4)
    for _ in range(3):
        results = _in_threads(work, points)
        for i, (got, x) in enumerate(zip(results, points)):
            assert not isinstance(got, Exception), f"thread {i}: {got!r}"
            torch.testing.assert_close(got, reference(x), msg=f"thread {i}")


class _Cube(torch.autograd.Function):
    # (old-style: forward takes ctx, no setup_context; torch.func cannot run it, and the
    # loop strategies compute it with plain autograd)
    @staticmethod
    def forward(ctx, a):
        ctx.save_for_backward(a)
        ctx.a = a
        return a**3

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        return 3 * a * a * g

    @staticmethod
    def jvp(ctx, t):
        return 3 * ctx.a * ctx.a * t


@pytest.mark.parametrize("strategy", ["rev-loop", "fwd-loop", "auto"])
def test_a_plain_loop_is_not_refused_while_another_thread_computes_forward_mode(strategy):
    # the loops ask whether plain forward-mode AD runs around them (it does not nest); the
    # dual level another thread's forward product had open was read as this thread's, and
    # a function torch.func cannot run was refused with torch.func's error
    entered, done = threading.Event(), threading.Event()

    def holds_a_level(a):
        # (tv.jvp calls f once, inside its dual level)
        entered.set()
        done.wait(timeout=1.0)  # (until this thread's Jacobian is done, or a second)
        return a.sin()

    other, tangent = torch.randn(3, dtype=D), torch.randn(3, dtype=D)
    result = {}

    def run_other():
        result["jt"] = tv.jvp(holds_a_level, (other,), (tangent,))[1]

    thread = threading.Thread(target=run_other)
    thread.start()
    try:
        assert entered.wait(timeout=10)
        x = torch.randn(4, dtype=D)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            J = tv.jacobian(_Cube.apply, x, strategy=strategy)
        torch.testing.assert_close(J, torch.diag(3 * x * x))
    finally:
        done.set()
        thread.join()
    torch.testing.assert_close(result["jt"], other.cos() * tangent)


def test_auto_checks_a_reverse_product_forward_holding_the_forward_lock(monkeypatch):
    # 'auto' checks a reverse product against one forward product (revcheck.reverse_wrong);
    # that forward product, too, runs one thread at a time: every torch.func.jvp the
    # call makes holds the lock
    from tests._references import WrongBackward
    from torch_vjp._engine import context

    held = []
    original = context._torch_jvp

    def recording(*args, **kwargs):
        held.append(context.FORWARD_AD._is_owned())
        return original(*args, **kwargs)

    monkeypatch.setattr(context, "_torch_jvp", recording)
    monkeypatch.setattr(torch.func, "jvp", recording)
    x = torch.randn(4, dtype=D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = tv.jacobian(lambda a: WrongBackward.apply(a).sin(), x, strategy="auto")
    assert held and all(held), held
    # (the reverse product was wrong: auto took forward mode, whose formula is right)
    torch.testing.assert_close(J, torch.diag(2 * (2 * x).cos()))
