"""Messages name an entry of a dict (or nested) output, cotangent or input by its place in
what the user wrote (``cotangents['b']``, ``outputs['c'][0]``, ``inputs['w']``), not by its
rank among the flattened tensors (``cotangents[1]``), which names another entry or none."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torch_vjp as tv


def _f(x):
    return {"a": x * 2, "b": x.sum(), "c": (x[:2] ** 2, x[0])}


def _explained(match, fn, *args):
    with pytest.raises(tv.GradOutputsError, match=match) as info:
        fn(*args)
    return str(info.value) + "\n" + str(getattr(info.value, "explanation", ""))


CASES = [
    pytest.param({"a": torch.ones(3), "b": torch.ones(3), "c": (torch.ones(2), torch.ones(()))},
                 "cotangents['b'] has shape (3,), but outputs['b'] has shape ().",
                 id="dict-entry"),
    pytest.param({"a": torch.ones(3), "b": torch.ones(()), "c": (torch.ones(3), torch.ones(()))},
                 "cotangents['c'][0] has shape (3,), but outputs['c'][0] has shape (2,).",
                 id="nested-entry"),
]


@pytest.mark.parametrize("cotangents, said", CASES)
def test_vjp_fn_names_a_dict_outputs_cotangent_by_key(cotangents, said):
    x = torch.randn(3)
    _, vjp_fn = tv.vjp(_f, x)
    msg = _explained(re.escape(said), vjp_fn, cotangents)
    key = said.split(" has")[0].removeprefix("cotangents")
    assert f"cotangents{key} is dL/d outputs{key}" in msg
    assert "cotangents[1]" not in msg and "cotangents[2]" not in msg


@pytest.mark.parametrize("cotangents, said", CASES)
def test_checked_func_vjp_names_a_dict_outputs_cotangent_by_key(cotangents, said):
    x = torch.randn(3)
    with tv.checked():
        _, vjp_fn = torch.func.vjp(_f, x)
        msg = _explained("Mismatch in shape", vjp_fn, cotangents)
    assert "torch.func.vjp: vjp_fn(cotangents): " + said in msg


def test_nested_tuple_outputs_name_the_entry_not_the_leaf_rank():
    x = torch.randn(3)
    _, vjp_fn = tv.vjp(lambda x: ((x, x * 2), x.sum()), x)
    msg = _explained(re.escape("cotangents[1] has shape (3,), but outputs[1] has shape ()"),
                     vjp_fn, ((torch.ones(3), torch.ones(3)), torch.ones(3)))
    assert "outputs[2]" not in msg


def test_a_cast_warning_names_the_key():
    x = torch.randn(3)
    _, vjp_fn = tv.vjp(lambda x: {"a": x * 2, "b": x.sum()}, x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (g,) = vjp_fn({"a": torch.ones(3), "b": torch.ones((), dtype=torch.float64)})
    torch.testing.assert_close(g, torch.full((3,), 3.0))
    said = [str(w.message) for w in caught if issubclass(w.category, tv.GradOutputsWarning)]
    assert said and "cotangents['b']" in said[0], said


def test_batched_none_names_the_key():
    x = torch.randn(3)
    _, vjp_fn = tv.vjp(lambda x: {"a": x * 2, "b": x.sum()}, x)
    with pytest.raises(tv.GradOutputsError, match=r"cotangents\['b'\]"):
        vjp_fn({"a": torch.ones(2, 3), "b": None}, batched=True)


@pytest.mark.parametrize("call", ["grad", "backward"])
def test_an_input_of_a_dict_of_inputs_is_named_by_key(call):
    w = torch.randn(3, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    y = w.sum() * b
    inputs = {"w": w, "b": b}
    if call == "grad":
        msg = _explained(r"shape \(3,\)", tv.grad, y, inputs, torch.ones(3))
    else:
        msg = _explained(r"shape \(3,\)", lambda: tv.backward(y, torch.ones(3), inputs=inputs))
    assert "(3,) is the shape of inputs['w']" in msg
    assert w.grad is None and b.grad is None


def test_checked_func_vjp_names_a_primal_of_a_dict_by_key():
    w = torch.randn(3)
    b = torch.randn(2)
    with tv.checked():
        _, vjp_fn = torch.func.vjp(lambda p: p["w"] * p["b"].sum(), {"w": w, "b": b})
        msg = _explained("Mismatch in shape", vjp_fn, torch.ones(2))
    assert "(2,) is the shape of primals[0]['b']" in msg
