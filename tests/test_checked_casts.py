"""Which dtype casts of a vector checked mode tells of (NOTE [which casts are told]): torch
casts a grad_outputs / gradient of another dtype to its output's silently. A cast that keeps
every value (a float32 vector for a float64 output) is valid code that gives the explicit
cast's result: no warning, so a test that asserts no warning around it still passes under
checked mode. A cast that rounds, or an integer vector, keeps its warning."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

F64 = torch.float64

# (output dtype, vector dtype): torch's cast keeps every value of the vector
_EXACT = [
    (F64, torch.float32),
    (F64, torch.float16),
    (torch.float32, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.complex128, torch.complex64),
]
# (output dtype, vector dtype): torch's cast may round, or the vector is an integer one
_TOLD = [
    (torch.float32, F64),
    (torch.float16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.complex64, torch.complex128),
    (torch.float32, torch.int64),
    (F64, torch.int32),
    (F64, torch.bool),
]


def _ids(cases):
    return [f"{str(o)[6:]}-out-{str(v)[6:]}-vector" for o, v in cases]


def _y(dtype):
    x = torch.tensor([0.5, -1.25, 2.0], dtype=dtype, requires_grad=True)
    return x, x * 3.0


def _vector(dtype):
    return torch.tensor([1.0, 0.0, 1.0]).to(dtype)


def _calls():
    def grad(y, x, v):
        return torch.autograd.grad(y, x, v)[0]

    def backward(y, x, v):
        y.backward(v)
        return x.grad

    def autograd_backward(y, x, v):
        torch.autograd.backward([y], [v])
        return x.grad

    def pullback(y, x, v):
        _, fn = torch.func.vjp(lambda t: t * 3.0, x.detach())
        return fn(v)[0]

    return {"autograd.grad": grad, "Tensor.backward": backward,
            "autograd.backward": autograd_backward, "func.vjp": pullback}


_CALLS = _calls()


def _ours(caught):
    return [str(w.message) for w in caught if issubclass(w.category, tv.TorchVJPWarning)]


@pytest.mark.parametrize("call", list(_CALLS), ids=list(_CALLS))
@pytest.mark.parametrize("out_dtype, vec_dtype", _EXACT, ids=_ids(_EXACT))
def test_an_exact_cast_is_valid_code_and_not_told(out_dtype, vec_dtype, call):
    x, y = _y(out_dtype)
    rx, ry = _y(out_dtype)
    ref = _CALLS[call](ry, rx, _vector(vec_dtype))  # torch alone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tv.checked():
            got = _CALLS[call](y, x, _vector(vec_dtype))
    assert not _ours(caught), _ours(caught)
    assert got.dtype == ref.dtype == out_dtype
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("out_dtype, vec_dtype", _EXACT, ids=_ids(_EXACT))
def test_the_drop_ins_tell_no_exact_cast(out_dtype, vec_dtype):
    x, y = _y(out_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.GradOutputsWarning)
        (g,) = tv.grad(y, x, _vector(vec_dtype), retain_graph=True)
        tv.backward(y, _vector(vec_dtype))
    expected = torch.tensor([3.0, 0.0, 3.0], dtype=out_dtype)
    torch.testing.assert_close(g, expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_an_exact_cast_of_a_batch_for_a_leaf_s_edge_is_not_told():
    # (is_grads_batched, the output a leaf's GradientEdge: the checker's stand-in for it)
    from torch.autograd.graph import get_gradient_edge

    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    v = torch.tensor([[1.0, 2.0, 3.0], [0.25, 0.5, 4.0]])
    (ref,) = torch.autograd.grad(x, x, v.to(F64), is_grads_batched=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.GradOutputsWarning)
        (got,) = tv.grad(get_gradient_edge(x), x, v, is_grads_batched=True)
        normalised = tv.check_grad_outputs([x * 1.0], [v[0]])
    assert got.dtype == F64 and normalised[0] is not None
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # a rounding one still is
    x32 = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    with pytest.warns(tv.GradOutputsWarning, match="to torch.float32 silently"):
        tv.grad(get_gradient_edge(x32), x32, v.to(F64), is_grads_batched=True)


def test_a_float32_ones_for_a_float64_output_under_the_environment_variable():
    # the plain torch idiom torch's own tests use inside assertNotWarn: torch.ones(3) (float32)
    # as the gradient of a float64 output, with checked mode on for the whole process
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "warnings.simplefilter('error')\n"
        "import torch_vjp\n"
        "x = torch.randn(3, dtype=torch.float64, requires_grad=True)\n"
        "(x * 2).backward(torch.ones(3))\n"
        "assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=torch.float64))\n"
        "print('ok')\n"
    )
    import os

    env = dict(os.environ, TORCH_VJP_CHECKED="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


@pytest.mark.parametrize("call", list(_CALLS)[:3], ids=list(_CALLS)[:3])
@pytest.mark.parametrize("out_dtype, vec_dtype", _TOLD, ids=_ids(_TOLD))
def test_a_rounding_or_integer_cast_is_still_told(out_dtype, vec_dtype, call):
    x, y = _y(out_dtype)
    with tv.checked(), pytest.warns(tv.GradOutputsWarning) as said:
        _CALLS[call](y, x, _vector(vec_dtype))
    msg = str(said[0].message)
    assert f"has dtype {vec_dtype} but" in msg and f"has dtype {out_dtype};" in msg, msg
    assert f"to {out_dtype} silently" in msg and f".to({out_dtype}) to make the cast " \
           "explicit" in msg, msg


# --------------------------------------------------------------------------------------
# A call the check rejects and torch accepts: torch's result, with a warning that says
# what was wrong, what was expected, why torch let it through, and the fix
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["tv.grad", "checked autograd.grad"])
def test_a_call_torch_accepts_over_the_check_is_told_in_full(monkeypatch, where):
    import torch_vjp._drop_ins as drop_ins

    def rejects(*args, **kwargs):  # a check that objects to a call torch accepts
        raise tv.GradOutputsError("grad_outputs[0] does not fit outputs[0] (the check)")

    monkeypatch.setattr(drop_ins, "normalize_grad_outputs", rejects)
    x = torch.tensor([0.5, -1.25, 2.0], dtype=F64, requires_grad=True)
    v = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    (expected,) = torch.autograd.grad(x * 3.0, x, v)
    with pytest.warns(tv.GradOutputsWarning) as said:
        if where == "tv.grad":
            (got,) = tv.grad(x * 3.0, x, v)
        else:
            with tv.checked():
                (got,) = torch.autograd.grad(x * 3.0, x, v)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    msg = str(said[0].message)
    call = "torch_vjp.grad" if where == "tv.grad" else "torch.autograd.grad"
    assert msg.startswith(f"{call}: torch_vjp's check rejects the grad_outputs of this call, "
                          "but torch accepted it and ran it; the result is torch's, "
                          "unchanged.\n"), msg
    assert "\n  Expected: each grad_outputs entry is dL/d(its output), so it has that " \
           "output's shape" in msg, msg
    assert "torch lets a vector that does not fit through only where it never uses it" in msg
    assert "\n  Fix: pass the vector the check asks for, or None for an output that needs " \
           "none." in msg, msg
    assert msg.endswith("\n  The check said:\ngrad_outputs[0] does not fit outputs[0] (the "
                        "check)"), msg
