"""Checked mode beside another library that patches the same entry points of torch (NOTE
[patches of other libraries] in ``torch_vjp._checked_scope``): a checked block puts the
checking wrapper on top of any patch and calls it, the last exit puts the patch back, a patch
that calls the wrapper back never recurses, and checks go on."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.autograd.function import BackwardCFunction

import torch_vjp as tv
from torch_vjp import _checked_mode, _checked_scope

_ENTRY_POINTS = ((torch.autograd, "grad"), (torch.autograd, "backward"),
                 (torch.Tensor, "backward"), (torch.func, "vjp"), (BackwardCFunction, "apply"))


@pytest.fixture(autouse=True)
def _restored():
    """Puts torch's entry points and checked mode's record of them back as they were."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr in _ENTRY_POINTS]
    records = [getattr(_checked_mode, name) for name in ("_PREVIOUS", "_REPLACED", "_BENEATH")
               if hasattr(_checked_mode, name)]
    state = [dict(d) for d in records]
    try:
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
        for d, old in zip(records, state):
            d.clear()
            d.update(old)


def _leaf():
    return torch.randn(3, requires_grad=True)


def test_a_tensor_backward_patch_made_after_a_block_survives_the_next_block():
    x = _leaf()
    with tv.checked():
        (x * 2).sum().backward()
    calls = []
    found = torch.Tensor.backward  # checked mode's wrapper: it stays after the block

    def logged(self, *args, **kwargs):
        calls.append(1)
        return found(self, *args, **kwargs)

    torch.Tensor.backward = logged
    with tv.checked():
        assert torch.Tensor.backward is found  # on top of the patch, which it calls
        with pytest.raises(tv.GradOutputsError, match=r"gradient has shape \(4,\)"):
            (x * 2).backward(torch.ones(4))  # still checked, through the library's patch
    assert torch.Tensor.backward is logged
    x.grad = None
    (x * 2).sum().backward()  # was RecursionError on every call from here on
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert len(calls) == 2


def test_a_grad_patch_made_inside_a_block_survives_the_next_block():
    x = _leaf()
    calls = []
    with tv.checked():
        found = torch.autograd.grad  # the checking wrapper

        def logged(*args, **kwargs):
            calls.append(1)
            return found(*args, **kwargs)

        torch.autograd.grad = logged
        torch.autograd.grad((x * 2).sum(), x)
    assert torch.autograd.grad is logged  # kept on the last exit
    torch.autograd.grad((x * 2).sum(), x)
    with tv.checked():
        assert torch.autograd.grad is found  # the next entry goes on top of it, and calls it
        (g,) = torch.autograd.grad((x * 2).sum(), x)  # was RecursionError
        assert torch.equal(g, torch.full((3,), 2.0))
        with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
            torch.autograd.grad(x * 2, x, torch.ones(4))
    assert torch.autograd.grad is logged
    assert len(calls) == 4


def test_a_patch_that_calls_the_wrapper_back_does_not_recurse():
    # the library took the checking wrapper in one block and installed its own after the
    # block had put torch's function back: the next block's wrapper calls the library's,
    # which calls the wrapper again
    x = _leaf()
    calls = []
    with tv.checked():
        found = torch.autograd.grad
    genuine = torch.autograd.grad
    assert genuine is not found

    def logged(*args, **kwargs):
        calls.append(1)
        return found(*args, **kwargs)

    torch.autograd.grad = logged
    with tv.checked():
        assert torch.autograd.grad is found
        (g,) = torch.autograd.grad((x * 3).sum(), x)
        torch.testing.assert_close(g, torch.full((3,), 3.0))
        with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
            torch.autograd.grad(x * 2, x, torch.ones(4))
    assert torch.autograd.grad is logged  # what the wrapper replaced, put back
    assert len(calls) == 2


def test_a_guarded_patch_still_sees_calls_made_from_within_a_backward_pass():
    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors
            with torch.enable_grad():
                u = t.detach().requires_grad_()
                (h,) = torch.autograd.grad((u * u).sum(), u)  # a new call, not a cycle
            return g * h

    x = _leaf()
    calls = []
    with tv.checked():
        found = torch.autograd.grad

    def logged(*args, **kwargs):
        calls.append(1)
        return found(*args, **kwargs)

    torch.autograd.grad = logged
    with tv.checked():
        (g,) = torch.autograd.grad(Inner.apply(x).sum(), x)
    torch.testing.assert_close(g, 2 * x.detach())
    assert len(calls) == 2


def test_a_patch_made_before_the_first_block_is_wrapped_and_put_back():
    x = _leaf()
    genuine = torch.autograd.grad
    calls = []

    def logged(*args, **kwargs):
        calls.append(1)
        return genuine(*args, **kwargs)

    torch.autograd.grad = logged
    with tv.checked():
        assert torch.autograd.grad is not logged
        with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
            torch.autograd.grad(x * 2, x, torch.ones(4))
        torch.autograd.grad((x * 2).sum(), x)
    assert torch.autograd.grad is logged
    assert len(calls) == 2  # the rejected call ran torch's function to judge it


def test_a_patch_removed_again_leaves_the_wrapper_to_be_put_back():
    x = _leaf()
    with tv.checked():
        found = torch.autograd.grad
        torch.autograd.grad = lambda *a, **k: found(*a, **k)  # noqa: E731
    torch.autograd.grad = found  # the library takes its patch away, after the block
    torch.autograd.grad((x * 2).sum(), x)  # the wrapper, outside any block: unchecked
    with tv.checked():
        assert torch.autograd.grad is found
        with pytest.raises(tv.GradOutputsError):
            torch.autograd.grad(x * 2, x, torch.ones(4))
    assert torch.autograd.grad is _checked_scope._GENUINE_GRAD


def test_an_error_a_patch_raises_itself_passes_through_a_rejected_call():
    x = _leaf()

    def refusing(*args, **kwargs):
        raise RuntimeError("the library's own refusal")

    torch.autograd.grad = refusing
    with tv.checked(), pytest.raises(RuntimeError, match="^the library's own refusal$") as info:
        torch.autograd.grad(x * 2, x, torch.ones(4))  # rejected: torch (here, the patch) judges
    assert type(info.value) is RuntimeError


def test_a_patch_that_calls_torch_directly_is_checked_in_the_next_blocks():
    # a library took torch's own function at import, and patches it inside a checked block:
    # the next blocks go on top of the patch (they kept off it, and checked nothing)
    x = _leaf()
    genuine = _checked_scope._GENUINE_GRAD
    calls = []
    with tv.checked():
        (x * 2).sum().backward()

    def logged(*args, **kwargs):
        calls.append(1)
        return genuine(*args, **kwargs)

    with tv.checked():
        torch.autograd.grad = logged  # the library's choice, in this block: unchecked
    assert torch.autograd.grad is logged
    for _ in range(2):
        with tv.checked():
            with pytest.raises(tv.GradOutputsError, match=r"grad_outputs\[0\] has shape \(4,\)"):
                torch.autograd.grad(x * 2, x, torch.ones(4))
            (g,) = torch.autograd.grad((x * 2).sum(), x)
            torch.testing.assert_close(g, torch.full((3,), 2.0))
        assert torch.autograd.grad is logged  # put back on the last exit
    assert len(calls) == 4  # the patch still runs (for the rejected call: torch judging it)


def test_a_tensor_backward_patch_that_calls_torch_directly_stays_checked():
    x = _leaf()
    genuine = _checked_scope._GENUINE_TENSOR_BACKWARD
    with tv.checked():
        (x * 2).sum().backward()
    calls = []

    def logged(self, *args, **kwargs):
        calls.append(1)
        return genuine(self, *args, **kwargs)

    torch.Tensor.backward = logged
    with tv.checked():
        with pytest.raises(tv.GradOutputsError, match=r"has shape \(4,\)"):
            (x * 2).backward(torch.ones(4))
    assert torch.Tensor.backward is logged  # put back on top on the last exit
    x.grad = None
    (x * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0)) and len(calls) == 2


def test_a_patch_taken_away_after_the_blocks_no_longer_runs():
    # a profiler's context patches Tensor.backward over the wrapper that stays, and puts back
    # what it found when it ends, after some checked blocks
    x = _leaf()
    with tv.checked():
        (x * 2).sum().backward()
    found, calls = torch.Tensor.backward, []

    def logged(self, *args, **kwargs):
        calls.append(1)
        return found(self, *args, **kwargs)

    torch.Tensor.backward = logged
    for _ in range(2):
        with tv.checked():
            (x * 2).sum().backward()
    assert len(calls) == 2
    torch.Tensor.backward = found
    (x * 2).sum().backward()
    with tv.checked():
        (x * 2).sum().backward()
    assert len(calls) == 2


def test_patches_on_patches_each_run_once_and_the_call_is_checked_once():
    x = _leaf()
    genuine = _checked_scope._GENUINE_GRAD
    calls = []

    def first(*args, **kwargs):  # made before any block, over torch's own function
        calls.append("first")
        return genuine(*args, **kwargs)

    torch.autograd.grad = first
    with tv.checked():
        found = torch.autograd.grad

        def second(*args, **kwargs):  # made over the wrapper, which it calls
            calls.append("second")
            return found(*args, **kwargs)

        torch.autograd.grad = second
    for block in (True, False):
        calls.clear()
        with tv.checked() if block else warnings.catch_warnings():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.autograd.grad((x * 2).sum(), x, torch.tensor(1.0, dtype=torch.float64))
        assert calls == ["second", "first"]
        assert len([w for w in caught if issubclass(w.category, tv.GradOutputsWarning)]) == (
            1 if block else 0)
        assert torch.autograd.grad is second


def test_a_custom_backward_through_a_node_patch_is_checked_once():
    class Wide(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g.double()  # cast by torch: a warning

    for calls_back in (True, False):
        with tv.checked():
            found = BackwardCFunction.apply
        genuine, calls = _checked_scope._GENUINE_NODE_APPLY, []

        def logged(self, *args, target=found if calls_back else genuine):
            calls.append(1)
            return target(self, *args)

        BackwardCFunction.apply = logged
        with tv.checked(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Wide.apply(_leaf()).sum().backward()
        assert len([w for w in caught if issubclass(w.category, tv.FunctionCheckWarning)]) == 1
        assert calls == [1] and BackwardCFunction.apply is logged
        BackwardCFunction.apply = genuine


_PROCESS_WIDE_SCRIPT = """
import torch, torch_vjp as tv
from torch_vjp import _checked_scope
genuine, calls = _checked_scope._GENUINE_GRAD, []
def logged(*args, **kwargs):
    calls.append(1)
    return genuine(*args, **kwargs)
torch.autograd.grad = logged  # a library that took torch's function before checks went on
x = torch.randn(3, requires_grad=True)
def attempt():
    try:
        torch.autograd.grad(x * 2, x, torch.ones(4))
    except Exception as e:
        return type(e).__name__
print(attempt())
with tv.checked():
    print(attempt())
print(attempt(), torch.autograd.grad is logged, len(calls))  # (the patch is back on top)
"""


def test_process_wide_checks_go_over_a_patch_in_the_next_block():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_VJP_")}
    env["TORCH_VJP_CHECKED"] = "1"
    out = subprocess.run([sys.executable, "-c", _PROCESS_WIDE_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["RuntimeError", "GradOutputsError", "RuntimeError",
                                  "True", "3"]


_ALIAS_SCRIPT = """
import torch, torch_vjp as tv
from torch.autograd import grad
x = torch.tensor([1., 2., 3., 4.], requires_grad=True)
y = torch.outer(x, x)
for call in (lambda: grad(y, x, torch.ones(4), retain_graph=True),
             lambda: torch.autograd.grad(y, x, torch.ones(4), retain_graph=True)):
    with tv.checked():
        try:
            call()
        except RuntimeError as e:
            print(type(e).__name__)
"""


@pytest.mark.parametrize("process_wide", [False, True])
def test_a_name_bound_to_grad_before_the_block_as_the_docs_say(process_wide):
    # docs/pages/grad-outputs.md: a block checks torch.autograd.grad where torch keeps it; a
    # name bound before it holds torch's own function, except with TORCH_VJP_CHECKED=1
    first = "GradOutputsError" if process_wide else "RuntimeError"
    if not process_wide and not any(k.startswith("TORCH_VJP_") for k in os.environ):
        # (a child of the fork server the distributed tests' ranks share: torch and
        # torch_vjp imported there once, with no TORCH_VJP_ variable, as in a fresh one)
        from _shared_functions import run_forked

        printed, error = run_forked(_ALIAS_SCRIPT, timeout=120)
        assert not error, error
        assert printed.split() == [first, "GradOutputsError"]
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_VJP_")}
    if process_wide:
        env["TORCH_VJP_CHECKED"] = "1"
    out = subprocess.run([sys.executable, "-c", _ALIAS_SCRIPT], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [first, "GradOutputsError"]
