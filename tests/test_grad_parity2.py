"""``tv.grad`` and ``tv.backward`` outside checked mode against torch's own functions (SPEC
§1): the same result for every call torch accepts, and a GradOutputsError that explains
every mistake, whatever the tensors are (subclasses with ``__torch_function__``, under a
``TorchFunctionMode``, GradientEdge outputs)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import jacrev
from torch.overrides import TorchFunctionMode

import torch_vjp as tv

F64 = torch.float64


class Logged(torch.Tensor):
    """A subclass that records the functions its ``__torch_function__`` is handed."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class Mode(TorchFunctionMode):
    """A mode that records the functions it is handed."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _x(kind):
    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    if kind == "Parameter":
        return torch.nn.Parameter(x)
    if kind == "Logged":
        return x.as_subclass(Logged).requires_grad_()
    return x.requires_grad_()


def _f(x):
    return x.sin() * 2, torch.outer(x, x)


# --------------------------------------------------------------------------------------
# Subclasses with __torch_function__, and TorchFunctionMode
# --------------------------------------------------------------------------------------

_WHERE = ["Logged input", "Logged output", "Logged grad_outputs", "Parameter", "mode"]


def _setup(where):
    """(x, outputs, the function making a vector like a given tensor, the context)."""
    x = _x({"Logged input": "Logged", "Parameter": "Parameter"}.get(where, "plain"))
    outs = _f(x)
    if where == "Logged output":
        outs = (outs[0].as_subclass(Logged), outs[1])
    like = (lambda t: t.as_subclass(Logged)) if where == "Logged grad_outputs" else (lambda t: t)
    return x, outs, like, Mode() if where == "mode" else _null()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("call", ["grad", "backward"])
@pytest.mark.parametrize("where", _WHERE)
def test_a_wrong_shape_is_explained_whatever_the_tensors_are(where, call):
    # with a subclass with __torch_function__ among the outputs or inputs (or a
    # TorchFunctionMode active) the checker was skipped: torch's own function ran, and a
    # wrong shape of the second output came back as torch 2.13's bare "The size of tensor a
    # (3) must match the size of tensor b (4)", naming neither output
    x, outs, like, ctx = _setup(where)
    gos = (like(torch.ones(3, dtype=F64)), like(torch.ones(3, dtype=F64)))
    with ctx, pytest.raises(tv.GradOutputsError) as info:
        if call == "grad":
            tv.grad(outs, x, gos)
        else:
            tv.backward(outs, gos)
    assert str(info.value).startswith(
        "Mismatch in shape: grad_output[1] has a shape of torch.Size([3]) and output[1] has "
        "a shape of torch.Size([3, 3])."), str(info.value)
    name = "grad_outputs" if call == "grad" else "grad_tensors"
    out = "outputs" if call == "grad" else "tensors"
    assert f"{name}[1] has shape (3,), but {out}[1] has shape (3, 3)" in \
        info.value.explanation, info.value.explanation


@pytest.mark.parametrize("where", _WHERE)
def test_a_wrong_batched_shape_is_explained_with_the_true_shapes(where):
    x, outs, like, ctx = _setup(where)
    gos = (like(torch.ones(2, 3, dtype=F64)), like(torch.ones(2, 3, 2, dtype=F64)))
    with ctx, pytest.raises(tv.GradOutputsError) as info:
        tv.grad(outs, x, gos, is_grads_batched=True)
    assert "grad_output[1] has a shape of torch.Size([3, 2]) and output[1] has a shape of " \
        "torch.Size([3, 3])" in str(info.value), str(info.value)
    assert "grad_outputs[1] has shape (2, 3, 2)" in info.value.explanation


@pytest.mark.parametrize("where", _WHERE)
def test_a_complex_vector_for_a_real_output_is_explained(where):
    x, outs, like, ctx = _setup(where)
    gos = (like(torch.ones(3, dtype=F64)), like(torch.ones(3, 3, dtype=torch.complex128)))
    with ctx, pytest.raises(tv.GradOutputsError, match="^For complex Tensors") as info:
        tv.grad(outs, x, gos)
    assert "grad_outputs[1]" in info.value.explanation, info.value.explanation


@pytest.mark.parametrize("call", ["grad", "backward"])
@pytest.mark.parametrize("where", _WHERE)
def test_valid_calls_with_subclasses_and_modes_are_torch_s(where, call):
    # the values against jacrev, and what __torch_function__ is handed: exactly what
    # torch's own function hands it (the checker reads the tensors out of its sight)
    v = (torch.tensor([1.0, 2.0, -1.0], dtype=F64),
         torch.arange(9, dtype=F64).reshape(3, 3) / 4)
    plain = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    j0, j1 = jacrev(_f)(plain)
    expected = torch.einsum("a,ab->b", v[0], j0) + torch.einsum("ab,abc->c", v[1], j1)
    got, seen = {}, {}
    for fn in ("torch", "tv"):
        x, outs, like, ctx = _setup(where)
        gos = tuple(like(t) for t in v)
        Logged.seen = []
        with ctx, warnings.catch_warnings():
            warnings.simplefilter("error")
            if call == "grad":
                run = torch.autograd.grad if fn == "torch" else tv.grad
                (got[fn],) = run(outs, x, gos)
            else:
                run = torch.autograd.backward if fn == "torch" else tv.backward
                run(outs, gos)
                got[fn] = x.grad
        seen[fn] = list(ctx.seen if where == "mode" else Logged.seen)
    torch.testing.assert_close(got["tv"], expected, rtol=0, atol=1e-12)
    assert torch.equal(got["tv"], got["torch"])
    assert type(got["tv"]) is type(got["torch"])
    if where != "Logged grad_outputs":  # (the checker reads a vector as torch's does not)
        assert seen["tv"] == seen["torch"]
