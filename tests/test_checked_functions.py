"""Checked mode checks what custom ``autograd.Function`` backwards return (SPEC §8, issue #12).

NOTE [checked custom backwards] in ``torch_vjp._checked_mode``. On every call, inside
``with tv.checked():`` and with ``TORCH_VJP_CHECKED=1``: what torch rejects raises a
``FunctionCheckError`` whose message is torch's own sentence, with torch_vjp's explanation as a
note; what torch takes silently (a gradient summed down to its input's shape, cast to its
dtype, misplaced) goes on with torch's result and a ``FunctionCheckWarning``; valid
backwards, however unusual, change nothing. Errors raised by the user's backward pass through.
"""

from __future__ import annotations

import _thread
import os
import re
import subprocess
import sys
import threading
import warnings

import pytest
import torch
from torch.autograd.function import BackwardCFunction, once_differentiable

import torch_vjp as tv
from torch_vjp import _checked_mode, _checked_scope
from torch_vjp._errors import full_message

from _references import twice_with


def _function(name, backward, forward=None, **attrs):
    """A custom Function class ``name``: forward ``2 * x`` (or ``forward``) and ``backward``."""
    def default_forward(ctx, x, *rest):
        return x * 2

    body = {"forward": staticmethod(forward or default_forward),
            "backward": staticmethod(backward), **attrs}
    return type(name, (torch.autograd.Function,), body)


def _leaf(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype).requires_grad_()


def _grads(fn, args):
    """The gradients of ``fn.apply(*args).sum()`` for the args that require grad."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    out = fn.apply(*args)
    return torch.autograd.grad(out.sum(), leaves, allow_unused=True)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y)


class _Jacobian(torch.autograd.Function):
    """The seed's Function: (n,) -> (k,) = (x.sum(), (x * x).sum(), x.prod()); its backward
    returns the (k, n) Jacobian instead of its product with grad_output."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.stack([x.sum(), (x * x).sum(), x.prod()])

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return torch.stack([torch.ones_like(x), 2 * x, x.prod() / x])  # WRONG: J, (3, n)


# ---------------------------------------------------------------------------------------
# The seed: a backward that returns the Jacobian, which torch sums away
# ---------------------------------------------------------------------------------------


def test_seed_jacobian_is_reported_on_every_call_inside_checked():
    x = _leaf(4)
    v = torch.tensor([1.0, 10.0, 100.0], dtype=torch.float64)
    (plain,) = torch.autograd.grad(_Jacobian.apply(x), x, v)  # torch: no error, J summed
    with tv.checked():
        for _ in range(2):  # every call, not once
            with pytest.warns(tv.FunctionCheckWarning) as record:
                (got,) = torch.autograd.grad(_Jacobian.apply(x), x, v)
            torch.testing.assert_close(got, plain)  # torch's result: warnings only
    message = str(record[0].message)
    assert message.startswith("torch_vjp.checked: _Jacobian.backward returned a gradient of "
                              "shape (3, 4) at index 0, but forward input 0 has shape (4,).")
    assert "never the Jacobian itself" in message
    assert "torch does not catch this: it sums the gradient down to (4,)" in message
    assert ("(3, 4) is the output's shape (3,) followed by input 0's shape (4,): the shape of "
            "the Jacobian d(the output)/d(input 0)") in message
    assert "Fix: return torch.tensordot(grad_output, J, dims=1)" in message
    assert record[0].filename == __file__  # points at the caller's backward call


def test_seed_jacobian_warning_can_be_made_an_error():
    x = _leaf(4)
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.FunctionCheckWarning)
        with pytest.raises(tv.FunctionCheckWarning, match=r"shape \(3, 4\) at index 0"):
            _Jacobian.apply(x).sum().backward()


def test_seed_per_example_jacobians_raise_with_torchs_sentence():
    # the seed thread's (b, k, n) for a (b, n) input, which torch rejects
    w = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    rows = _function("RowLayerJac", lambda ctx, g: torch.ones(5, 2, 3, dtype=torch.float64),
                     forward=lambda ctx, x: x @ w.mT)
    x = _leaf(5, 3)
    with pytest.raises(RuntimeError) as plain:
        rows.apply(x).sum().backward()
    with tv.checked(), pytest.raises(tv.FunctionCheckError) as info:
        rows.apply(x).sum().backward()
    assert str(info.value) == str(plain.value) == (
        "Function RowLayerJacBackward returned an invalid gradient at index 0 - got [5, 2, 3] "
        "but expected shape compatible with [5, 3]")
    assert isinstance(info.value, RuntimeError)
    explanation = info.value.explanation
    assert explanation.startswith("torch_vjp.checked: RowLayerJac.backward returned a gradient "
                                  "of shape (5, 2, 3) at index 0, but forward input 0 has shape "
                                  "(5, 3).")
    assert "(5, 2, 3) holds one Jacobian per example" in explanation
    assert "torch reports this as" not in explanation  # torch's sentence is already first
    assert full_message(info.value) == str(info.value) + "\n" + explanation
    assert x.grad is None


SEED_SCRIPT = """
import warnings, torch, torch_vjp as tv
from torch_vjp.autograd import is_checked
assert is_checked()

class Jacobian(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.stack([x.sum(), (x * x).sum()])

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return torch.stack([torch.ones_like(x), 2 * x])   # WRONG: J, (2, n)

class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x ** 3

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.sum(0)                          # WRONG: (n,) for (m, n)

x = torch.ones(4, requires_grad=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Jacobian.apply(x).sum().backward()
    Jacobian.apply(x).sum().backward()
print("WARNED", len(caught), caught[0].category.__name__, str(caught[0].message).splitlines()[0])
try:
    Cube.apply(torch.ones(3, 4, requires_grad=True)).sum().backward()
except tv.FunctionCheckError as e:
    print("RAISED", str(e))
    print("NOTE", e.__notes__[0].splitlines()[0])
"""


def test_seed_with_the_environment_variable():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_VJP_")}
    env["TORCH_VJP_CHECKED"] = "1"
    out = subprocess.run([sys.executable, "-c", SEED_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (
        "WARNED 2 FunctionCheckWarning torch_vjp.checked: Jacobian.backward returned a gradient "
        "of shape (2, 4) at index 0, but forward input 0 has shape (4,).")
    assert lines[1] == ("RAISED Function CubeBackward returned an invalid gradient at index 0 - "
                        "got [4] but expected shape compatible with [3, 4]")
    assert lines[2] == ("NOTE torch_vjp.checked: Cube.backward returned a gradient of shape "
                        "(4,) at index 0, but forward input 0 has shape (3, 4).")


# ---------------------------------------------------------------------------------------
# Every mistake: what torch rejects raises (torch's sentence first), what it takes warns
# ---------------------------------------------------------------------------------------

def _exp_like(ctx, g):
    return g * 2


MISTAKES = {
    # name: (Function, args, "raises" or "warns", explanation pattern)
    "count-missing": (
        _function("Scale", lambda ctx, g: g * 2), lambda: (_leaf(4), _leaf(4, seed=1)),
        "raises",
        r"^torch_vjp\.checked: Scale\.backward returned 1 value, but Scale\.forward takes 2 "
        r"inputs \(not counting ctx\), so backward must return 2\.(.|\n)*"
        r"Fix: return a value for input 1 \(shape \(4,\)\) as well"),
    "count-extra-tensor": (
        _function("Scale", lambda ctx, g: (g * 2, g)), lambda: (_leaf(4),), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned 2 values, but Scale\.forward takes 1 "
        r"input(.|\n)*Fix: return exactly 1 value, one per input of forward after ctx"),
    "list": (
        _function("Scale", lambda ctx, g: [g * 2]), lambda: (_leaf(4),), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a list of 1 value; torch reads a list "
        r"as one single value, which is not a gradient\.(.|\n)*Fix: return a tuple"),
    "python-number": (
        _function("Scale", lambda ctx, g: 2.0), lambda: (_leaf(4),), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a float at index 0; backward returns, "
        r"at each index, a tensor \(dL/d input 0\) or None\.(.|\n)*Fix: return a tensor with "
        r"input 0's shape \(4,\)"),
    "ndarray": (
        _function("Scale", lambda ctx, g: (g * 2).detach().numpy()), lambda: (_leaf(4),),
        "raises",
        r"^torch_vjp\.checked: Scale\.backward returned an ndarray at index 0; backward "
        r"returns, at each index, a tensor \(dL/d input 0\) or None\."),
    "tensor-for-non-tensor-input": (
        _function("Scale", lambda ctx, g: (g * 2, torch.ones(()))), lambda: (_leaf(4), 2.0),
        "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a tensor at index 1, but forward input "
        r"1 is not a tensor\.(.|\n)*Fix: return None at index 1"),
    # (beside a tensor input that needs no gradient, the node does not tell which inputs
    # were tensors: torch's raw RuntimeError came through unexplained)
    "tensor-for-non-tensor-input-beside-a-constant-tensor": (
        _function("Scale", lambda ctx, g: (g * 2, None, torch.ones(()))),
        lambda: (_leaf(4), torch.ones(4, dtype=torch.float64), 2.0), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a value other than None at index 2, but "
        r"forward input 2 is not a tensor\.(.|\n)*Fix: return None at index 2"),
    "shape-incompatible": (
        _function("Scale", lambda ctx, g: (g * 2).mT), lambda: (_leaf(4, 3),), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a gradient of shape \(3, 4\) at index "
        r"0, but forward input 0 has shape \(4, 3\)\.(.|\n)*torch's \"shape compatible with "
        r"\[4, 3\]\" means \(4, 3\) itself, or a shape that \(4, 3\) broadcasts to(.|\n)*"
        r"shape reversed: return grad\.mT"),
    # (a frozen tensor and a number beside it: the node does not tell which of the two is
    # the tensor, so the check cannot replay torch's verdict beforehand; torch's raw
    # RuntimeError came through unexplained)
    "shape-beside-a-frozen-tensor-and-a-number": (
        _function("Lin", lambda ctx, g: ((g * 2).mT, g, None),
                  forward=lambda ctx, x, w, eps: x * 2 + w + eps),
        lambda: (_leaf(4, 3), _leaf(4, 3, seed=1).detach(), 0.5), "raises",
        r"^torch_vjp\.checked: Lin\.backward returned a gradient of shape \(3, 4\) at index "
        r"0, but forward input 0 has shape \(4, 3\)\.(.|\n)*shape reversed: return grad\.mT"),
    "number-beside-an-index-tensor-and-a-number": (
        _function("Pick", lambda ctx, g: (g * 2, 1.0, None),
                  forward=lambda ctx, x, index, k: x * 2),
        lambda: (_leaf(4), torch.tensor([1, 2]), 3), "raises",
        r"^torch_vjp\.checked: Pick\.backward returned a float at index 1; backward returns, at "
        r"each index, a tensor \(dL/d input 1\) or None\."),
    "grad-output-returned-for-a-reduction": (
        _function("RowSum", lambda ctx, g: g, forward=lambda ctx, x: x.sum(1)),
        lambda: (_leaf(4, 3),), "raises",
        r"shape \(4,\) at index 0, but forward input 0 has shape \(4, 3\)(.|\n)*\(4,\) is the "
        r"shape of the output \(and of grad_output\)"),
    "complex-for-real": (
        _function("Scale", lambda ctx, g: (g * 2).to(torch.complex128)), lambda: (_leaf(4),),
        "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a gradient of dtype torch\.complex128 at "
        r"index 0, but forward input 0 has dtype torch\.float64\.(.|\n)*never turns a complex "
        r"gradient into a real one"),
    "wrong-device": (
        _function("Scale", lambda ctx, g: torch.ones(4, dtype=g.dtype, device="meta")),
        lambda: (_leaf(4),), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a gradient on device meta at index 0, "
        r"but forward input 0 is on cpu\.(.|\n)*Fix: create the tensors backward needs on "
        r"grad_output\.device"),
    # (torch would cast the float32 gradient to float64, then rejects its device: the
    # explanation of the device was missing, torch's raw RuntimeError came through)
    "wrong-device-and-dtype": (
        _function("Scale", lambda ctx, g: torch.ones(4, device="meta")),
        lambda: (_leaf(4),), "raises",
        r"^torch_vjp\.checked: Scale\.backward returned a gradient on device meta at index 0, "
        r"but forward input 0 is on cpu\.(.|\n)*Fix: create the tensors backward needs on "
        r"grad_output\.device"),
    # (torch sums these down to the input's shape, then rejects the device: the explanation
    # of the device was missing, torch's raw RuntimeError came through)
    "summed-shape-on-the-wrong-device": (
        _function("Exp", lambda ctx, g: torch.diag(g * 2).to("meta")), lambda: (_leaf(4),),
        "raises",
        r"^torch_vjp\.checked: Exp\.backward returned a gradient on device meta at index 0, "
        r"but forward input 0 is on cpu\.(.|\n)*Fix: create the tensors backward needs on "
        r"grad_output\.device"),
    "broadcast-idiom-on-the-wrong-device": (
        _function("Rows", lambda ctx, g: (g * 2).to("meta"),
                  forward=lambda ctx, x: x.expand(3, 4) * 2),
        lambda: (_leaf(4),), "raises",
        r"^torch_vjp\.checked: Rows\.backward returned a gradient on device meta at index 0, "
        r"but forward input 0 is on cpu\.(.|\n)*Fix: create the tensors backward needs on "
        r"grad_output\.device"),
    "jacobian-summed": (
        _function("Exp", lambda ctx, g: torch.diag(g * 2)), lambda: (_leaf(4),), "warns",
        r"^torch_vjp\.checked: Exp\.backward returned a gradient of shape \(4, 4\) at index 0, "
        r"but forward input 0 has shape \(4,\)\.(.|\n)*torch does not catch this: it sums the "
        r"gradient down to \(4,\)(.|\n)*the shape of the Jacobian d\(the output\)/d\(input 0\)"),
    "extra-leading-dimension-summed": (
        _function("Scale", lambda ctx, g: (g * 2).expand(2, 4, 3)), lambda: (_leaf(4, 3),),
        "warns",
        r"shape \(2, 4, 3\) at index 0, but forward input 0 has shape \(4, 3\)(.|\n)*torch does "
        r"not catch this(.|\n)*extra leading dimension of size 2(.|\n)*return grad\.sum\(0\)"),
    "broadcast-dimension-not-summed": (
        _function("Scale", lambda ctx, g: (g * 2).expand(4, 3)), lambda: (_leaf(1, 3),), "warns",
        r"shape \(4, 3\) at index 0, but forward input 0 has shape \(1, 3\)(.|\n)*"
        r"grad\.sum\(dim=0, keepdim=True\)"),
    "float64-for-float32": (
        _function("Scale", lambda ctx, g: (g * 2).double()),
        lambda: (_leaf(4, dtype=torch.float32),), "warns",
        r"^torch_vjp\.checked: Scale\.backward returned a gradient of dtype torch\.float64 at "
        r"index 0, but forward input 0 has dtype torch\.float32\.(.|\n)*torch does not catch "
        r"this: it casts the gradient to torch\.float32 without a word"),
    "integer-for-float": (
        _function("Scale", lambda ctx, g: torch.ones(4, dtype=torch.int64)),
        lambda: (_leaf(4),), "warns",
        r"dtype torch\.int64 at index 0, but forward input 0 has dtype torch\.float64"),
}


@pytest.mark.parametrize("case", MISTAKES, ids=list(MISTAKES))
def test_mistakes(case):
    fn, make_args, outcome, pattern = MISTAKES[case]
    if outcome == "raises":
        with pytest.raises(RuntimeError) as plain:
            _grads(fn, make_args())
        with tv.checked(), pytest.raises(tv.FunctionCheckError) as info:
            _grads(fn, make_args())
        err = info.value
        assert isinstance(err, RuntimeError)
        assert str(err) == str(plain.value)  # torch's own sentence first
        assert err.__notes__ == [err.explanation]
        assert err.explanation.count("\n") >= 2  # what, why, fix
        assert "torch reports this as" not in err.explanation
        assert err.__cause__ is None and err.__suppress_context__
        explanation = err.explanation
    else:
        reference = _grads(fn, make_args())  # torch takes it without a word
        with tv.checked(), pytest.warns(tv.FunctionCheckWarning) as record:
            got = _grads(fn, make_args())
        _same(got, reference)  # and checked mode changes nothing but the warning
        assert len(record) == 1
        explanation = str(record[0].message)
    assert explanation.startswith("torch_vjp.checked: ")
    assert re.search(pattern, explanation), explanation


# ---------------------------------------------------------------------------------------
# Valid backwards, however unusual, change nothing
# ---------------------------------------------------------------------------------------

class _SetupContextExp(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.exp()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return grad_output * y


class _BroadcastMul(torch.autograd.Function):
    """x * y with broadcasting, each gradient in the output's shape: torch sums it down (the
    idiom of ``NumpyMul`` in torch's own autograd_function_db)."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, grad_output):
        x, y = ctx.saved_tensors
        return grad_output * y, grad_output * x


class _Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output * 2


class _SortValues(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        values, index = x.sort()
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        return values, index

    @staticmethod
    def backward(ctx, grad_values, grad_index):
        (index,) = ctx.saved_tensors
        return torch.zeros_like(grad_values).scatter(0, index, grad_values)


class _NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        total = None
        for g, k in ((g1, 2), (g2, 3)):
            if g is not None:
                total = g * k if total is None else total + g * k
        return total


class _SparseRows(torch.autograd.Function):
    """An embedding lookup whose weight gradient is a sparse COO tensor."""

    @staticmethod
    def forward(ctx, weight, index):
        ctx.save_for_backward(index)
        ctx.rows = weight.shape[0]
        return weight[index]

    @staticmethod
    def backward(ctx, grad_output):
        (index,) = ctx.saved_tensors
        grad = torch.sparse_coo_tensor(index[None], grad_output,
                                       (ctx.rows, grad_output.shape[1]), check_invariants=False)
        return grad, None


class _Vjp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def vjp(ctx, grad_output):
        return grad_output * 3


class _OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 2

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        return 2 * x * grad_output


class _Boxed(torch.autograd.Function):
    boxed_grads_call = True

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grads):
        grad = grads.pop(0)  # backward may free what it was given
        return grad * 2


def _apply_and_sum(fn):
    return lambda *args: fn.apply(*args).sum()


def _one_output(fn):
    return lambda *args: fn.apply(*args)[0].sum()


VALID = {
    # name: (function of the args, args)
    "none-for-an-input-that-needs-grad": (
        _apply_and_sum(_function("Drops", lambda ctx, g: (g, None),
                                 forward=lambda ctx, x, y: x + y)),
        lambda: (_leaf(3), _leaf(3, seed=1))),
    "extra-trailing-none": (
        _apply_and_sum(_function("Extra", lambda ctx, g: (g * 2, None, None))),
        lambda: (_leaf(3),)),
    "gradient-for-an-input-that-needs-none": (
        _apply_and_sum(_function("All", lambda ctx, g: (g * 2, g),
                                 forward=lambda ctx, x, y: x * 2 + y)),
        lambda: (_leaf(3), _leaf(3, seed=1).detach())),
    "gradient-for-an-integer-input": (
        _apply_and_sum(_function("Gather", lambda ctx, g: (g, torch.ones(3)),
                                 forward=lambda ctx, x, i: x[i])),
        lambda: (_leaf(3), torch.tensor([2, 0, 1]))),
    "non-tensor-inputs": (
        _apply_and_sum(_function("Affine", lambda ctx, g: (g * 3, None, None, None),
                                 forward=lambda ctx, x, a, name, opts: x * 3 + a)),
        lambda: (_leaf(3), 1.5, "affine", {"k": 1})),
    "mixed-inputs-some-need-no-grad": (
        _apply_and_sum(_function("Mixed", lambda ctx, g: (g, g, None),
                                 forward=lambda ctx, x, w, a: x + w * a)),
        lambda: (_leaf(3), _leaf(3, seed=1).detach(), 2.0)),
    "broadcast-idiom": (_apply_and_sum(_BroadcastMul), lambda: (_leaf(4), _leaf(3, 4, seed=1))),
    "expanded-gradient": (
        _apply_and_sum(_function("Sum", lambda ctx, g: g.expand(4, 3),
                                 forward=lambda ctx, x: x.sum())),
        lambda: (_leaf(4, 3),)),
    "setup-context": (_apply_and_sum(_SetupContextExp), lambda: (_leaf(3),)),
    "view-input": (lambda x: _SetupContextExp.apply(x[1:].T).sum(), lambda: (_leaf(3, 2),)),
    "mark-dirty": (lambda x: _Dirty.apply(x.clone()).sum(), lambda: (_leaf(3),)),
    "mark-non-differentiable": (_one_output(_SortValues), lambda: (_leaf(5),)),
    "materialize-grads-false": (_one_output(_NoMaterialize), lambda: (_leaf(3),)),
    "sparse-gradient": (
        lambda w, i: _SparseRows.apply(w, i).sum(),
        lambda: (_leaf(5, 2), torch.tensor([4, 0, 4]))),
    "vjp-staticmethod": (_apply_and_sum(_Vjp), lambda: (_leaf(3),)),
    "once-differentiable": (_apply_and_sum(_OnceDifferentiable), lambda: (_leaf(3),)),
    "boxed-grads": (_apply_and_sum(_Boxed), lambda: (_leaf(3),)),
    "complex": (_apply_and_sum(_function("Conj", lambda ctx, g: g * 2)),
                lambda: (_leaf(3, dtype=torch.complex128),)),
    "zero-dim": (_apply_and_sum(_function("Scalar", lambda ctx, g: g * 2)), lambda: (_leaf(),)),
    # torch sums these down over dimensions of size 1 only: the gradient, exactly
    "keepdim-bias-gradient": (
        _apply_and_sum(_function("AddBias", lambda ctx, g: (g, g.sum(0, keepdim=True)),
                                 forward=lambda ctx, x, b: x + b)),
        lambda: (_leaf(4, 3), _leaf(3, seed=1))),
    "one-element-gradient-of-a-0d-input": (
        _apply_and_sum(_function("Scale", lambda ctx, g: (g * 2, g.sum().reshape(1, 1)),
                                 forward=lambda ctx, x, t: x * 2 + t)),
        lambda: (_leaf(4, 3), _leaf(seed=1))),
}


def _grad_of(f, args, create_graph=False):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    out = f(*args)
    if out.is_complex():
        out = out.real
    return torch.autograd.grad(out, leaves, allow_unused=True, create_graph=create_graph)


@pytest.mark.parametrize("case", VALID, ids=list(VALID))
def test_valid_backwards_change_nothing(case):
    f, make_args = VALID[case]
    reference = _grad_of(f, make_args())
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")  # not a warning of any kind
        got = _grad_of(f, make_args())
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.layout == b.layout
            assert torch.equal(a.to_dense(), b.to_dense())


def test_double_backward_through_a_custom_function():
    def second(x):
        (g,) = torch.autograd.grad(_SetupContextExp.apply(x).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(g.sum(), x)

    x = _leaf(3)
    expected = second(x)
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = second(x)
    torch.testing.assert_close(got, expected)


def test_torchs_own_reference_functions():
    """Every Function of torch's own autograd_function_db (vmap rules, mark_dirty, numpy,
    broadcasting, defaults): the same gradients and double gradients, no warning; except
    ZeroGradientsGenVmap, whose backward returns a too-large gradient on purpose (torch sums
    it down): the same gradients, and a warning."""
    db = pytest.importorskip("torch.testing._internal.autograd_function_db")
    from torch.utils._pytree import tree_flatten

    def run(op, sample):
        args = (sample.input, *sample.args)
        leaves = [a for a in tree_flatten(args)[0]
                  if isinstance(a, torch.Tensor) and a.requires_grad]
        outs = [o for o in tree_flatten(op.op(*args, **sample.kwargs))[0]
                if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                    allow_unused=True, create_graph=op.supports_gradgrad)
        result = list(grads)
        again = [g for g in grads if g is not None and g.requires_grad]
        if again:
            result += torch.autograd.grad([g.sum() for g in again], leaves, allow_unused=True)
        return result

    warned = set()
    for op in db.autograd_function_db:
        for sample in op.sample_inputs("cpu", torch.float64, requires_grad=True):
            expected = run(op, sample)
            with tv.checked(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = run(op, sample)
            _same(got, expected)
            for w in caught:
                assert issubclass(w.category, tv.FunctionCheckWarning), w.message
                warned.add(op.name)
    assert warned == {"ZeroGradientsGenVmapAutogradFunction"}


# ---------------------------------------------------------------------------------------
# torch.func, torch.compile, nested tensors
# ---------------------------------------------------------------------------------------

class _ExpReturnsJacobian(_SetupContextExp):
    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_tensors
        return torch.diag(y)  # WRONG: the Jacobian


def test_torch_func_transforms_over_custom_functions():
    x = torch.randn(3, dtype=torch.float64)
    batch = torch.randn(2, 3, dtype=torch.float64)
    calls = {
        "grad": lambda: torch.func.grad(lambda t: _SetupContextExp.apply(t).sum())(x),
        "vjp": lambda: torch.func.vjp(_SetupContextExp.apply, x)[1](torch.ones(3).double()),
        "jacrev": lambda: torch.func.jacrev(_SetupContextExp.apply)(x),
        "vmap-grad": lambda: torch.func.vmap(torch.func.grad(
            lambda t: _SetupContextExp.apply(t).sum()))(batch),
        "tv.jacobian": lambda: tv.jacobian(_SetupContextExp.apply, x),
    }
    for name, call in calls.items():
        expected = call()
        with tv.checked(), warnings.catch_warnings():
            warnings.simplefilter("error")
            got = call()
        torch.testing.assert_close(got, expected, msg=name)


def test_jacobian_returned_under_torch_func_grad_warns():
    x = torch.randn(3, dtype=torch.float64)
    f = torch.func.grad(lambda t: _ExpReturnsJacobian.apply(t).sum())
    expected = f(x)
    with tv.checked(), pytest.warns(tv.FunctionCheckWarning, match=(
            r"^torch_vjp\.checked: _ExpReturnsJacobian\.backward returned a gradient of shape "
            r"\(3, 3\) at index 0, but forward input 0 has shape \(3,\)")):
        got = f(x)
    torch.testing.assert_close(got, expected)


def test_torch_rejects_under_torch_func_grad_with_its_own_error():
    few = _function("Few", lambda ctx, g: g, forward=lambda ctx, x, y: x * y)

    def f(x):
        return torch.func.grad(lambda t: few.apply(t, t).sum())(x)

    with pytest.raises(RuntimeError) as plain:
        f(torch.randn(3))
    with tv.checked(), pytest.raises(RuntimeError) as info:
        f(torch.randn(3))
    assert str(info.value) == str(plain.value)


def test_torch_compile():
    model = torch.nn.Linear(4, 3)

    def loss(x):
        return _OnceDifferentiable.apply(model(x)).sum()

    x = torch.randn(5, 4)
    (expected,) = torch.autograd.grad(loss(x), model.weight)
    compiled = torch.compile(loss, backend="aot_eager")
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.TorchVJPWarning)
        (got,) = torch.autograd.grad(compiled(x), model.weight)
    torch.testing.assert_close(got, expected)


def test_nested_tensor_input_is_left_to_torch():
    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)],
                                    layout=torch.jagged, requires_grad=True)
    double = _function("Double", lambda ctx, g: g * 2)
    (expected,) = torch.autograd.grad(double.apply(nt).values().sum(), nt)
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.TorchVJPWarning)
        (got,) = torch.autograd.grad(double.apply(nt).values().sum(), nt)
    assert torch.equal(got.values(), expected.values())


# ---------------------------------------------------------------------------------------
# Errors of the user's own backward, check_function, scope, restoring torch
# ---------------------------------------------------------------------------------------

class _UserError(Exception):
    pass


def test_error_raised_by_the_users_backward_passes_through():
    error = _UserError("backward is broken")

    def backward(ctx, g):
        raise error

    broken = _function("Broken", backward)
    with tv.checked(), pytest.raises(_UserError) as info:
        broken.apply(_leaf(3)).sum().backward()
    assert info.value is error
    assert not getattr(error, "__notes__", None)


def test_check_function_inside_checked_reports_as_check_function():
    with tv.checked(), pytest.raises(tv.FunctionCheckError, match=(
            r"^torch_vjp\.check_function\(_Jacobian\): _Jacobian\.backward returned a gradient "
            r"of shape \(3, 4\)")):
        tv.check_function(_Jacobian, torch.randn(4, dtype=torch.float64))


def test_nothing_is_checked_outside_checked():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _Jacobian.apply(_leaf(4)).sum().backward()  # torch's silence


def test_node_wrapper_stays_and_checks_nothing_outside_checked():
    """The custom-backward wrapper is not put back on exit (assigning a BackwardCFunction
    attribute invalidates the caches of every custom Function's node class): outside a
    checked scope it defers to torch's method and checks nothing."""
    with tv.checked():
        wrapper = BackwardCFunction.__dict__["apply"]
        assert wrapper is _checked_mode._checked_node_apply
    assert BackwardCFunction.__dict__["apply"] is wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _Jacobian.apply(_leaf(4)).sum().backward()  # torch's silence, through the wrapper
    with tv.checked(), pytest.warns(tv.FunctionCheckWarning):
        _Jacobian.apply(_leaf(4)).sum().backward()


def test_a_patch_of_another_library_is_kept():
    genuine = _checked_scope._GENUINE_NODE_APPLY
    calls = []

    with tv.checked():
        wrapper = BackwardCFunction.__dict__["apply"]

    def other(self, *args):  # a library's patch, which calls what it found: ours
        calls.append(1)
        return wrapper(self, *args)

    try:
        with tv.checked():
            BackwardCFunction.apply = other
        assert BackwardCFunction.__dict__["apply"] is other
        with tv.checked():  # ours on top of it, calling it (NOTE [patches of other libraries])
            assert BackwardCFunction.__dict__["apply"] is wrapper
            with pytest.warns(tv.FunctionCheckWarning):  # checked still, through the patch
                _Jacobian.apply(_leaf(4)).sum().backward()
        assert calls == [1] and BackwardCFunction.__dict__["apply"] is other
    finally:
        BackwardCFunction.apply = genuine
        with tv.checked():  # torch's own function put back: the wrapper goes over it again
            assert BackwardCFunction.__dict__["apply"] is wrapper


def test_scope_is_per_thread():
    results = {}
    started, done = threading.Event(), threading.Event()

    def other():
        started.wait(10)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _Jacobian.apply(_leaf(4)).sum().backward()
        results["other"] = [w.category for w in caught]
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with tv.checked():
        started.set()
        done.wait(10)
        with pytest.warns(tv.FunctionCheckWarning):
            _Jacobian.apply(_leaf(4)).sum().backward()
    thread.join(10)
    assert results == {"other": []}


def test_engine_threads_are_checked_while_a_checked_pass_is_in_flight():
    """torch runs the backward of CUDA tensors on its own threads, which no checked block
    enters: those are checked while a checked backward pass is in flight. A thread that
    Python's threading did not start stands in for one here."""
    seen = {}

    def probe(key, done):
        seen[key] = _checked_scope._checks_backwards()
        done.release()

    def in_foreign_thread(key):
        done = _thread.allocate_lock()
        done.acquire()
        _thread.start_new_thread(probe, (key, done))
        assert done.acquire(timeout=10)

    in_foreign_thread("idle")
    with tv.checked():
        in_foreign_thread("checked block, no pass in flight")
        with _checked_scope._in_flight_pass():
            in_foreign_thread("in flight")
            python_thread = threading.Thread(target=lambda: seen.update(
                python=_checked_scope._checks_backwards()))
            python_thread.start()
            python_thread.join(10)
    assert seen == {"idle": False, "checked block, no pass in flight": False,
                    "in flight": True, "python": False}


def _backward_fails(ctx, g):
    raise RuntimeError("the user's own backward failed: singular matrix")


_BackwardFails = twice_with(_backward_fails)  # (2 x, whose backward raises)


def test_the_users_own_error_from_backward_passes_through_a_rejected_pullback_call():
    # the check objects to a cotangent torch ignores (an output that does not depend on x),
    # so torch's pullback runs to judge; the user's backward then raised, and checked mode
    # replaced that error with a GradOutputsError about the ignored cotangent
    def f(t):
        return _BackwardFails.apply(t), torch.ones(2)

    x = torch.randn(3)
    cotangents = (torch.ones(3), torch.ones(5))
    with pytest.raises(RuntimeError, match="the user's own backward failed") as plain:
        torch.func.vjp(f, x)[1](cotangents)
    with tv.checked(), pytest.warns(tv.GradOutputsWarning, match="but torch ignores it"):
        with pytest.raises(RuntimeError, match="the user's own backward failed") as checked:
            torch.func.vjp(f, x)[1](cotangents)
    assert type(checked.value) is type(plain.value) is RuntimeError


class _SummedDown(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.sum(0)

    @staticmethod
    def backward(ctx, g):
        return g  # wrong: (4,) for an input of shape (3, 4), which torch rejects


@pytest.mark.parametrize("step, error", [
    (lambda act: _SummedDown.apply(act).sum().backward(), tv.FunctionCheckError),
    (lambda act: torch.autograd.grad(act * 2, act, torch.ones(5)), tv.GradOutputsError),
    (lambda act: (act * 2).backward(torch.ones(5)), tv.GradOutputsError),
], ids=["custom-backward", "grad", "tensor-backward"])
def test_a_checked_error_leaves_no_reference_cycle_behind(step, error):
    # the replay's error was kept with its traceback, whose frames lead back to the frames
    # holding it and on to the user's step: the step's activations stayed alive until the
    # cyclic collector ran (plain torch frees them as soon as the error is handled)
    import gc
    import weakref

    def run():
        act = torch.randn(3, 4, requires_grad=True) * 3
        alive = weakref.ref(act)
        with pytest.raises(error):
            with tv.checked():
                step(act)
        del act
        return alive

    enabled = gc.isenabled()
    gc.disable()
    try:
        alive = run()
        assert alive() is None
    finally:
        if enabled:
            gc.enable()


class _AmpMatmul(torch.autograd.Function):
    """The custom Function of torch's AMP examples: forward in float32 whatever autocast
    does around it (``custom_fwd(cast_inputs=torch.float32)``)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class _AmpAutocastBackward(torch.autograd.Function):
    """``custom_fwd`` without cast_inputs: forward and (``custom_bwd``) backward run under
    autocast, so a float32 input gets a bfloat16 gradient, which torch casts back."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


@pytest.mark.parametrize("fn", [_AmpMatmul, _AmpAutocastBackward])
def test_amp_custom_functions_under_autocast_change_nothing(fn):
    """torch's documented AMP recipe for custom Functions (custom_fwd/custom_bwd) returns
    gradients in the dtype autocast computed them in; torch casts them to each input's dtype
    by design, so a training step under autocast is valid code: no warning."""

    def step():
        lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            lin.weight.copy_(_leaf(4, 4, dtype=torch.float32))
            lin.bias.zero_()
        w = _leaf(4, 3, dtype=torch.float32, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = lin(_leaf(2, 4, dtype=torch.float32, seed=2).detach())  # bfloat16
            loss = fn.apply(h, w).float().sum()
        loss.backward()
        return lin.weight.grad, lin.bias.grad, w.grad

    reference = step()
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step()
    _same(got, reference)


class _LinearUnderAutocast(torch.autograd.Function):
    """A linear map with no AMP decorators, run under autocast: forward's matmul computes in
    bfloat16, and backward computes the gradients in the precision of its grad_output."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.to(g.dtype), g.t() @ x.to(g.dtype)


class _InFloat64(torch.autograd.Function):
    """Computes in float64 (forward returns float64), so its gradients are float64 too."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.double().exp()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.double().exp()


def test_gradients_in_the_precision_of_forwards_outputs_change_nothing():
    """A Function whose outputs have another floating dtype than its inputs (autocast's
    bfloat16, a float64 computation) returns gradients in its outputs' precision; torch casts
    each back to its input's dtype, as it does for its own ``.to()``: valid code, no warning."""

    def step():
        x = _leaf(2, 4, dtype=torch.float32)
        w = _leaf(3, 4, dtype=torch.float32, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = _LinearUnderAutocast.apply(x, w)
        loss = y.float().sum() + _InFloat64.apply(x).sum()
        loss.backward()
        return x.grad, w.grad

    reference = step()
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step()
    _same(got, reference)


def test_torchs_own_error_class_is_kept_where_torch_raises_another_builtin():
    """torch sums a (3, 4) gradient of a 0-d input down to 0-d and then moves it to the input's
    device: from the meta device it cannot, and raises NotImplementedError. That error is not
    one of torch's validation sentences; it comes through as torch raised it (checked mode
    raised a FunctionCheckError, which `except NotImplementedError` does not catch)."""
    fn = _function("Total", lambda ctx, g: torch.ones(3, 4, dtype=g.dtype, device="meta"))
    with pytest.raises(NotImplementedError) as plain:
        _grads(fn, (_leaf(),))
    with tv.checked(), pytest.raises(NotImplementedError) as checked:
        _grads(fn, (_leaf(),))
    assert str(checked.value) == str(plain.value)


def test_float64_gradient_of_a_custom_fwd_function_outside_autocast_still_warns():
    """custom_fwd outside autocast changes nothing: a float64 gradient for a float32 input
    there is the mistake it always was."""

    class Scale(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx, x):
            return x * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            return (g * 2).double()

    with tv.checked(), pytest.warns(tv.FunctionCheckWarning, match="dtype torch.float64"):
        _grads(Scale, (_leaf(3, dtype=torch.float32),))


def test_float64_gradient_of_a_custom_fwd_function_under_autocast_still_warns():
    """Under autocast, custom_bwd's backward computes in autocast's dtype or in float32; a
    float64 tensor made inside it for a float32 input is not autocast's precision: the
    mistake is reported as outside autocast."""

    class Scale(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x @ w

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t(), (x.t() @ g).double()

    x = _leaf(3, 4, dtype=torch.float32)
    w = _leaf(4, 5, dtype=torch.float32, seed=1)
    with tv.checked(), pytest.warns(tv.FunctionCheckWarning, match="dtype torch.float64"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = Scale.apply(x, w)
        y.float().sum().backward()


def test_narrower_gradient_where_an_output_keeps_the_inputs_dtype_still_warns():
    """A Function with outputs of two dtypes, one of them its input's (float32) and one
    narrower (a float16 copy): a float16 gradient for the float32 input is not the precision
    the Function computes in, but a precision lost in backward; it is reported as for a
    Function with a single float32 output."""

    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, (x * 3).half()

        @staticmethod
        def backward(ctx, g1, g2):
            return g1.half() * 2 + g2 * 3

    x = _leaf(5, dtype=torch.float32)
    with tv.checked(), pytest.warns(tv.FunctionCheckWarning, match="dtype torch.float16"):
        a, b = Two.apply(x)
        (a.sum() + b.float().sum()).backward()


def test_wider_gradient_of_a_function_with_outputs_of_two_dtypes_changes_nothing():
    """Outputs in float32 and float64: backward's sum of their grad_outputs promotes to
    float64, the precision of one of forward's outputs; torch casts it back: no warning."""

    class Two(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2, x.double() * 3

        @staticmethod
        def backward(ctx, g1, g2):
            return g1 * 2 + g2 * 3

    def step():
        x = _leaf(5, dtype=torch.float32)
        a, b = Two.apply(x)
        (a.sum() + b.sum()).backward()
        return (x.grad,)

    reference = step()
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step()
    _same(got, reference)


def test_objection_left_to_torch_is_explained_in_its_own_thread_only():
    """Two threads run the same Function, each with a transposed gradient of its own shape,
    beside a frozen tensor and a number (torch judges it, the explanation waits for torch's
    error). The other thread's objection, kept meanwhile, must neither replace this thread's
    (a note about another shape than torch's sentence) nor be lost to it."""

    class Lin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, s):
            ctx.save_for_backward(x, w)
            return (x @ w.t()) * s

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return (g @ w * 0.5).t(), g.t() @ x, None

    first_kept, second_kept, first_done = (threading.Event(), threading.Event(),
                                           threading.Event())
    judge = _checked_mode._judge_backward

    def interleaved(node, returned):
        judge(node, returned)
        if threading.current_thread().name == "first":
            first_kept.set()
            second_kept.wait(10)   # the second thread keeps its objection meanwhile
        else:
            second_kept.set()
            first_done.wait(10)    # and meets torch's error after the first thread

    results = {}

    def run(n):
        name = threading.current_thread().name
        if name == "second":
            first_kept.wait(10)
        x = _leaf(n, 4, dtype=torch.float32)
        try:
            with tv.checked():
                Lin.apply(x, torch.ones(3, 4), 0.5).sum().backward()
        except RuntimeError as err:
            results[name] = (type(err), str(err), full_message(err))
        if name == "first":
            first_done.set()

    _checked_mode._judge_backward = interleaved
    try:
        threads = [threading.Thread(target=run, args=(n,), name=name)
                   for n, name in ((2, "first"), (5, "second"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        _checked_mode._judge_backward = judge
    for name, n in (("first", 2), ("second", 5)):
        cls, sentence, full = results[name]
        assert cls is tv.FunctionCheckError, name
        assert sentence.startswith(f"Function LinBackward returned an invalid gradient at "
                                   f"index 0 - got [4, {n}]")
        assert f"gradient of shape (4, {n}) at index 0" in full


def test_complex_gradients_in_the_precision_of_forwards_outputs_change_nothing():
    """As for real dtypes: a Function that computes in complex128 for a complex64 input
    returns its gradient in complex128, which torch casts back: valid code, no warning."""

    class InComplex128(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            return z.to(torch.complex128) * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def step():
        z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
        InComplex128.apply(z).abs().sum().backward()
        return (z.grad,)

    torch.manual_seed(0)
    reference = step()
    torch.manual_seed(0)
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step()
    _same(got, reference)


def test_autocast_result_beside_a_float32_statistic_changes_nothing():
    """Under autocast, without AMP decorators: forward's result is bfloat16 (its matmul),
    beside a float32 statistic marked non-differentiable; backward's gradients are in the
    result's precision, bfloat16, for float32 inputs: valid code, no warning (the float32
    output does not make bfloat16 a precision lost in backward)."""

    class WithStat(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            stat = x.float().pow(2).mean()
            ctx.mark_non_differentiable(stat)
            ctx.save_for_backward(x, w)
            return x @ w.t(), stat

        @staticmethod
        def backward(ctx, g, gstat):
            x, w = ctx.saved_tensors
            return g @ w.to(g.dtype), g.t() @ x.to(g.dtype)

    def step():
        x = _leaf(2, 4, dtype=torch.float32)
        w = _leaf(3, 4, dtype=torch.float32, seed=1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = WithStat.apply(x, w)
        y.float().sum().backward()
        return x.grad, w.grad

    reference = step()
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step()
    _same(got, reference)


def test_float32_gradient_of_a_float64_input_under_autocast_still_warns():
    """Autocast casts no float64 tensor (forward here computes in float64, its output is
    float64): a float32 gradient made in custom_bwd's backward for a float64 input is
    precision lost, not autocast's, and is reported as outside autocast (it was accepted:
    torch casts it back to float64 without a word)."""

    class Scale(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return (g * w).float(), (g * x).float()

    x = _leaf(3, dtype=torch.float64)
    w = _leaf(3, dtype=torch.float32, seed=1)
    with tv.checked(), pytest.warns(tv.FunctionCheckWarning, match="dtype torch.float32"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = Scale.apply(x, w)
        y.sum().backward()
