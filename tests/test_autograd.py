"""Checked autograd (SPEC §1): results equal torch's, and every error explains itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp import _checked_mode, autograd


def _outer():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    return x, torch.outer(x, x)


def _raises(match: str, fn, *args, **kwargs) -> str:
    """Runs ``fn``, expects a GradOutputsError whose message or notes match ``match``, and
    returns torch_vjp's explanation (the note under torch's sentence)."""
    with pytest.raises(tv.GradOutputsError, match=match) as info:
        fn(*args, **kwargs)
    return info.value.explanation


# --------------------------------------------------------------------------------------
# Same results as torch
# --------------------------------------------------------------------------------------


def _same(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        a, b = tuple(a.values()), tuple(b.values())
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
        else:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)


GRAD_CASES = {
    "outer-ones": lambda x: ((torch.outer(x, x),), (torch.ones(4, 4, dtype=x.dtype),), {}),
    "scalar-none": lambda x: (((x * x).sum(),), None, {}),
    "two-outputs": lambda x: ((x.sin(), torch.outer(x, x)), (torch.ones(4), torch.randn(4, 4)), {}),
    "one-element-none": lambda x: (((x * x).sum().reshape(1, 1),), None, {}),
    "create-graph": lambda x: (((x ** 3).sum(),), None, {"create_graph": True}),
    "batched": lambda x: ((x.sin(),), (torch.eye(4),), {"is_grads_batched": True}),
    "allow-unused": lambda x: (((x * 2).sum(),), None, {"allow_unused": True, "extra_input": True}),
    "materialize": lambda x: (((x * 2).sum(),), None, {"materialize_grads": True, "extra_input": True}),
    "int-grad-outputs": lambda x: ((x * 2,), (torch.arange(4),), {}),
}


@pytest.mark.parametrize("case", GRAD_CASES, ids=list(GRAD_CASES))
def test_grad_matches_torch(case):
    results = []
    for fn in (torch.autograd.grad, tv.grad):
        torch.manual_seed(1)
        x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
        outputs, gos, kw = GRAD_CASES[case](x)
        inputs = [x]
        if kw.pop("extra_input", False):
            inputs.append(torch.ones(2, requires_grad=True))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.GradOutputsWarning)
            results.append(fn(outputs, inputs, gos, **kw))
    _same(results[0], results[1])


def test_grad_dict_inputs_match_torch():
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    y = (x * w).sum()
    expected = torch.autograd.grad(y, {"x": x, "w": w}, retain_graph=True)
    got = tv.grad(y, {"x": x, "w": w})
    assert isinstance(got, dict)
    _same(expected, got)


def test_backward_matches_torch_and_accumulates():
    grads = []
    for fn in (torch.autograd.backward, tv.backward):
        x = torch.tensor([[1.0, 2.0]], requires_grad=True)
        y = torch.stack([2 * x[0, 0] + x[0, 1] ** 2, x[0, 0] ** 2 + 2 * x[0, 1] ** 3])[None]
        fn(y, torch.tensor([[1.0, 0.0]]), retain_graph=True)
        fn(y, torch.tensor([[0.0, 1.0]]))
        grads.append(x.grad)
    # rows of J = [[2, 4], [2, 24]] accumulate: [2, 4] + [2, 24]
    torch.testing.assert_close(grads[1], torch.tensor([[4.0, 28.0]]))
    assert torch.equal(grads[0], grads[1])


def test_backward_inputs_restricts_accumulation():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    tv.backward((a * b).sum(), inputs=[a])
    assert a.grad is not None and b.grad is None


def test_grad_does_not_touch_dot_grad_or_flags():
    x = torch.randn(3, requires_grad=True)
    tv.grad((x * x).sum(), x)
    assert x.grad is None and x.requires_grad


def test_check_grad_outputs_normalises():
    x = torch.randn(3, requires_grad=True)
    s, v = (x * x).sum(), x * 2
    g = torch.randn(3)
    out = tv.check_grad_outputs([s, v], [None, g])
    assert torch.equal(out[0], torch.ones(())) and out[1] is g
    # nothing ran: the graph is intact and x.grad untouched
    assert x.grad is None
    (s + v.sum()).backward()


# --------------------------------------------------------------------------------------
# Error messages: the call, the index, both shapes, the expected shape and why, the fix
# --------------------------------------------------------------------------------------


def test_err_input_shape_passed_by_mistake():
    x, y = _outer()
    msg = _raises(r"grad_outputs\[0\] has shape \(4,\), but outputs\[0\] has shape \(4, 4\)",
                  tv.grad, y, x, torch.ones_like(x))
    assert msg.startswith("torch_vjp.grad: ")
    assert "dL/d outputs[0]" in msg and "must have shape (4, 4)" in msg
    assert "(4,) is the shape of inputs[0]" in msg
    assert "torch.ones_like(outputs[0])" in msg


def test_err_second_output_is_named():
    # torch 2.13 reports "Boolean value of Tensor with more than one value is ambiguous" or
    # an unrelated broadcasting error here.
    x = torch.randn(4, requires_grad=True)
    a, b = x * 2, torch.outer(x, x)
    with pytest.raises(RuntimeError, match="ambiguous|must match the size"):
        torch.autograd.grad([a, b], x, [torch.ones(4), torch.ones(3)], retain_graph=True)
    _raises(r"grad_outputs\[1\] has shape \(3,\), but outputs\[1\] has shape \(4, 4\)",
            tv.grad, [a, b], x, [torch.ones(4), torch.ones(3)])
    _raises(r"grad_outputs\[1\] has shape \(4,\), but outputs\[1\] has shape \(4, 4\)",
            tv.grad, [a, b], x, [torch.ones(4), torch.ones(4)])


def test_err_extra_leading_batch_dimension():
    x, y = _outer()
    msg = _raises(r"grad_outputs\[0\] has shape \(3, 4, 4\), but outputs\[0\] has shape \(4, 4\)",
                  tv.grad, y, x, torch.ones(3, 4, 4))
    assert "extra leading dimension of size 3" in msg and "is_grads_batched=True" in msg


def test_err_one_element_for_a_scalar_names_its_own_shape():
    # a (1, 1) vector for a 0-d output was told 'torch.Size([1]) and torch.Size([]) differ'
    x = torch.randn(3, requires_grad=True)
    msg = _raises(r"grad_outputs\[0\] has shape \(1, 1\), but outputs\[0\] has shape \(\)",
                  tv.grad, x.sum(), x, torch.ones(1, 1))
    assert "(1, 1) is not (): torch.Size([1, 1]) and torch.Size([]) differ" in msg
    msg = _raises(r"has shape \(1,\)", tv.grad, x.sum(), x, torch.ones(1))
    assert "torch.Size([1]) and torch.Size([]) differ" in msg


def test_err_extra_leading_dimension_of_size_one_is_squeezed():
    # it was told 'If it holds 1 vector, one per vector-Jacobian product, pass
    # is_grads_batched=True', the batch reading of a stray unsqueeze
    x, y = _outer()
    msg = _raises(r"grad_outputs\[0\] has shape \(1, 4, 4\), but outputs\[0\] has shape \(4, 4\)",
                  tv.grad, y, x, torch.ones(1, 4, 4))
    assert "extra leading dimension of size 1" in msg
    assert "pass grad_outputs[0].squeeze(0)" in msg
    assert "If it holds 1 vector" not in msg
    (g,) = tv.grad(y, x, torch.ones(1, 4, 4).squeeze(0))
    torch.testing.assert_close(g, torch.func.jacrev(lambda t: torch.outer(t, t))(
        x.detach()).sum(dim=(0, 1)))


def test_err_one_weight_per_row_gets_the_expand_that_works():
    # a (B,) vector of per-example weights for a (B, k) output got no fix at all
    x = torch.randn(3, 4, requires_grad=True)
    y = x.tanh()
    w = torch.tensor([1.0, 2.0, 3.0])
    msg = _raises(r"grad_outputs\[0\] has shape \(3,\), but outputs\[0\] has shape \(3, 4\)",
                  tv.grad, y, x, w, retain_graph=True)
    assert "(3,) is the shape of outputs[0]'s leading dimension (3,)" in msg
    assert "pass grad_outputs[0].reshape((3, 1)).expand_as(outputs[0])" in msg
    (g,) = tv.grad(y, x, w.reshape(3, 1).expand_as(y))
    torch.testing.assert_close(g, w[:, None] * (1 - y.detach() ** 2))


def test_err_output_cut_off_from_inputs_that_require_grad_is_not_told_to_set_it():
    # an output computed under torch.no_grad() from an input that requires grad was told
    # 'Fix: create the inputs with requires_grad=True', which they already were
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        z = x * 2
    msg = _raises(r"element 0 of tensors does not require grad", tv.grad, z, x, torch.ones(4))
    assert ("inputs[0] already requires grad, so if outputs[0] was computed from it, the "
            "graph was cut on the way") in msg
    assert "Fix: compute outputs[0] with grad mode on, from it directly" in msg
    assert "create the inputs with requires_grad=True" not in msg
    w = torch.randn(4)                          # here requires_grad is what is missing
    msg = _raises(r"does not require grad", tv.grad, w * 2, w, torch.ones(4))
    assert "Fix: create the inputs with requires_grad=True" in msg


def test_err_vectors_of_several_outputs_stacked_into_one_entry():
    # the count is told first (NOTE [the order of mistakes]), with what the shape tells of
    # it, and a fix that works
    x = torch.randn(3, requires_grad=True)
    y, z = x * 2, x * 3
    msg = _raises(r"^got 2 tensors and 1 gradients", tv.grad, [y, z], x, torch.ones(2, 3))
    assert "outputs has 2 entries but grad_outputs has 1" in msg
    assert "list(grad_outputs[0]) or grad_outputs[0].unbind(0)" in msg
    assert "is_grads_batched" not in msg
    (g,) = tv.grad([y, z], x, list(torch.ones(2, 3)))
    torch.testing.assert_close(g, torch.full((3,), 5.0))


def test_err_rows_of_one_vector_given_as_several_entries():
    x = torch.randn(3, requires_grad=True)
    y = x.expand(2, 3) * 2
    msg = _raises(r"grad_outputs\[0\] has shape \(3,\), but outputs\[0\] has shape \(2, 3\)",
                  tv.grad, y, x, list(torch.ones(2, 3).unbind(0)))
    assert "outputs has 1 entry but grad_outputs has 2" in msg
    assert "look like the 2 rows of one vector" in msg and "torch.stack" in msg
    assert "expand_as" not in msg


def test_err_missing_leading_batch_dimension():
    x = torch.randn(5, 3, requires_grad=True)
    y = x.tanh()
    w = torch.randn(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        msg = _raises(r"grad_outputs\[0\] has shape \(3,\), but outputs\[0\] has shape \(5, 3\)",
                      tv.grad, y, torch.randn(2, requires_grad=True), w)
    assert "lacks the leading dimension of size 5" in msg
    assert "grad_outputs[0].expand_as(outputs[0])" in msg


def test_err_batched_reports_true_shapes():
    x, y = _outer()
    # torch strips the batch dimension twice: it prints Size([3]) for a (3, 4, 3) tensor.
    with pytest.raises(RuntimeError, match=r"has a shape of torch.Size\(\[3\]\)"):
        torch.autograd.grad(y, x, torch.ones(3, 4, 3), retain_graph=True, is_grads_batched=True)
    msg = _raises(r"grad_outputs\[0\] has shape \(3, 4, 3\), but outputs\[0\] has shape \(4, 4\) "
                  r"and is_grads_batched=True", tv.grad, y, x, torch.ones(3, 4, 3),
                  is_grads_batched=True)
    # K is not known from another entry: the message must not suggest (3, 4, 4)
    assert "must have shape (K, 4, 4), K being the number of products" in msg


def test_err_batched_mixed_with_unbatched():
    x = torch.randn(4, requires_grad=True)
    a, b = x * 2, torch.outer(x, x)
    msg = _raises(r"grad_outputs\[1\] has shape \(4, 4\), but outputs\[1\] has shape \(4, 4\) "
                  r"and is_grads_batched=True", tv.grad, [a, b], x,
                  [torch.ones(3, 4), torch.ones(4, 4)], is_grads_batched=True)
    assert "no batch dimension, while other grad_outputs have one of size 3" in msg
    assert "grad_outputs[1].expand(3, *outputs[1].shape)" in msg


def test_err_batched_without_batch_dimension_single():
    x = torch.randn(4, requires_grad=True)
    msg = _raises(r"grad_outputs\[0\] has shape \(4,\)", tv.grad, x * 2, x, torch.ones(4),
                  is_grads_batched=True)
    assert "pass is_grads_batched=False" in msg


def test_err_batched_sizes_differ():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="batch sizes"):  # also a ValueError, like torch's
        tv.grad([x * 2, x * 3], x, [torch.ones(3, 4), torch.ones(2, 4)], is_grads_batched=True)
    _raises(r"different batch sizes \(grad_outputs\[0\]: 3, grad_outputs\[1\]: 2\)", tv.grad,
            [x * 2, x * 3], x, [torch.ones(3, 4), torch.ones(2, 4)], is_grads_batched=True)


@pytest.mark.parametrize(
    "out_shape, go_shape, expected",
    [
        ((), (1,), r"torch.Size\(\[1\]\) and torch.Size\(\[\]\) differ"),
        ((1,), (), r"one element but shape \(1,\), not \(\)"),
    ],
    ids=["size1-for-scalar", "scalar-for-size1"],
)
def test_err_size1_vs_scalar(out_shape, go_shape, expected):
    x = torch.randn(3, requires_grad=True)
    y = (x * x).sum().reshape(out_shape)
    msg = _raises(expected, tv.grad, y, x, torch.ones(go_shape))
    assert "leave it None" in msg


def test_err_transposed():
    x = torch.randn(2, 3, requires_grad=True)
    msg = _raises(r"grad_outputs\[0\] has shape \(3, 2\), but outputs\[0\] has shape \(2, 3\)",
                  tv.grad, x * 2, torch.randn(5, requires_grad=True), torch.ones(3, 2))
    assert "reversed: did you mean grad_outputs[0].mT?" in msg


def test_err_reshape_and_broadcast_fixes():
    x = torch.randn(2, 6, requires_grad=True)
    msg = _raises(r"has shape \(3, 4\)", tv.grad, x * 2, x, torch.ones(3, 4))
    assert "right number of elements (12)" in msg and ".reshape(outputs[0].shape)" in msg
    msg = _raises(r"has shape \(1, 1\)", tv.grad, x * 2, x, torch.ones(1, 1))
    assert "does not broadcast" in msg and ".expand_as(outputs[0])" in msg


def test_err_non_scalar_without_grad_outputs():
    x, y = _outer()
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar"):
        torch.autograd.grad(y, x, retain_graph=True)
    msg = _raises(r"outputs\[0\] has shape \(4, 4\) \(16 elements\), and no grad_outputs\[0\] "
                  r"was given", tv.grad, y, x)
    assert "only from a scalar output" in msg
    assert "torch.ones_like(outputs[0])" in msg and "torch_vjp.jacobian_of" in msg


def test_err_output_does_not_require_grad():
    x = torch.randn(3, requires_grad=True)
    detached = (x * 2).detach()
    msg = _raises(r"outputs\[1\] \(shape \(3,\)\) does not require grad", tv.grad,
                  [x.sum(), detached], x, [None, torch.ones(3)])
    assert "requires_grad=True" in msg and ".detach()" in msg


def test_err_one_tensor_that_does_not_require_grad_has_a_plain_fix():
    # (the fix ended "or leave y out of y" for Tensor.backward's one tensor)
    y = torch.randn(3) * 2
    with tv.checked(), pytest.raises(tv.GradOutputsError) as info:
        y.sum().backward()
    msg = info.value.explanation
    assert msg.endswith("before computing y.") and "out of y" not in msg


def test_warn_a_sequence_of_gradients_for_one_tensor():
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    with tv.checked(), pytest.warns(tv.GradOutputsWarning, match=(
            r"^y\.backward\(gradient\): gradient is a sequence of 2 tensors for the one "
            r"tensor y; torch uses the first and ignores the other 1\. gradient is dL/dy, one "
            r"tensor of y's shape: pass that tensor itself")):
        y.backward([torch.ones(3), torch.full((3,), 5.0)])
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "out_dtype, go_dtype, fix",
    [
        (torch.float32, torch.complex64, r"pass a real grad_outputs\[0\] of dtype torch.float32"),
        (torch.complex64, torch.float32, r"pass grad_outputs\[0\].to\(torch.complex64\)"),
    ],
    ids=["complex-for-real", "real-for-complex"],
)
def test_err_complex_vs_real(out_dtype, go_dtype, fix):
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).to(out_dtype)
    msg = _raises(rf"grad_outputs\[0\] has dtype {go_dtype}, but outputs\[0\] has dtype "
                  rf"{out_dtype}", tv.grad, y, x, torch.ones(3, dtype=go_dtype))
    assert re.search(fix, msg) and "never between complex and real" in msg


def test_err_complex_scalar_without_grad_outputs():
    x = torch.randn(3, requires_grad=True)
    y = (x.to(torch.complex64) * 1j).sum()
    _raises(r"outputs\[0\] is a scalar of dtype torch.complex64, and no grad_outputs\[0\] was "
            r"given", tv.grad, y, x)


def test_err_wrong_device_meta():
    x = torch.randn(3, requires_grad=True)
    msg = _raises(r"grad_outputs\[0\] is on device meta, but outputs\[0\] is on cpu", tv.grad,
                  x * 2, x, torch.ones(3, device="meta"))
    assert "grad_outputs[0].to(outputs[0].device)" in msg


@pytest.mark.cuda
def test_err_wrong_device_cuda():
    x = torch.randn(3, requires_grad=True)
    _raises(r"grad_outputs\[0\] is on device cuda:0, but outputs\[0\] is on cpu", tv.grad,
            x * 2, x, torch.ones(3, device="cuda"))


def test_err_too_few_grad_outputs():
    x = torch.randn(4, requires_grad=True)
    msg = _raises(r"got 2 outputs but 1 grad_outputs", tv.grad, [x * 2, x * 3], x,
                  [torch.ones(4)])
    assert "shapes (4,), (4,)" in msg
    msg = _raises(r"got 2 outputs but 1 grad_outputs", tv.grad, [x * 2, x * 3], x, torch.ones(4))
    assert "A single Tensor counts as one entry" in msg


def test_warn_too_many_grad_outputs_torch_ignores_them():
    x = torch.randn(4, requires_grad=True)
    with pytest.warns(tv.GradOutputsWarning, match="got 2 grad_outputs for 1 outputs; torch ignores"):
        (g,) = tv.grad(x * 2, x, [torch.ones(4), torch.ones(7)])
    torch.testing.assert_close(g, torch.full((4,), 2.0))


@pytest.mark.parametrize(
    "go, match",
    [
        (1.0, r"grad_outputs is a float, but it must be a Tensor, a list or tuple"),
        ([1.0, 1.0, 1.0], r"grad_outputs\[0\] is a float, but each entry of grad_outputs must be a "
                          r"Tensor or None"),
    ],
    ids=["float", "list-of-floats"],
)
def test_err_wrong_type(go, match):
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(TypeError, match=match):  # a TypeError too, as torch raises
        tv.grad(x * 2 if isinstance(go, list) else (x * x).sum(), x, go)
    with pytest.raises(tv.GradOutputsError):
        tv.grad((x * 2) if isinstance(go, list) else (x * x).sum(), x, go)


@pytest.mark.parametrize(
    "dtype, what",
    [(torch.float64, "torch.float64"), (torch.int64, "integer")],
    ids=["float64", "int64"],
)
def test_warn_silent_cast(dtype, what):
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(tv.GradOutputsWarning, match=rf"torch casts the {what} grad_outputs to "
                                                  rf"torch.float32 silently"):
        (g,) = tv.grad(x * 2, x, torch.ones(3, dtype=dtype))
    assert g.dtype == torch.float32
    assert issubclass(tv.GradOutputsWarning, UserWarning)


def test_err_backward_names_leaf_shape():
    w = torch.randn(4, requires_grad=True)
    y = torch.outer(w, w)
    msg = _raises(r"torch_vjp.backward: grad_tensors\[0\] has shape \(4,\), but tensors\[0\] has "
                  r"shape \(4, 4\)", tv.backward, y, torch.ones(4))
    assert msg.startswith("torch_vjp.backward: ")
    assert "(4,) is the shape of a leaf tensor that tensors[0] was computed from" in msg


def test_errors_are_runtime_errors():
    x, y = _outer()
    with pytest.raises(RuntimeError):
        tv.grad(y, x, torch.ones(4))
    assert issubclass(tv.GradOutputsError, tv.TorchVJPError)


def test_user_function_errors_pass_through():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            raise KeyError("raised by the user's backward")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(KeyError, match="raised by the user's backward"):
        tv.grad(Boom.apply(x).sum(), x)


# --------------------------------------------------------------------------------------
# checked(): torch's own entry points, checked
# --------------------------------------------------------------------------------------


def test_checked_tensor_backward():
    x = torch.ones(4, requires_grad=True)
    with tv.checked():
        msg = _raises(r"y.backward\(gradient\): gradient has shape \(3,\), but y has shape \(4,\)",
                      (x * 2).backward, torch.ones(3))
        assert msg.startswith("y.backward(gradient): ")
        assert "gradient is dL/d y" in msg
        (x * 2).backward(torch.ones(4))
    torch.testing.assert_close(x.grad, torch.full((4,), 2.0))


def test_checked_autograd_grad_and_backward():
    x, y = _outer()
    with tv.checked():
        msg = _raises(r"torch.autograd.grad: grad_outputs\[0\] has shape \(4,\)",
                      torch.autograd.grad, y, x, torch.ones(4))
        assert msg.startswith("torch.autograd.grad: ")
        msg = _raises(r"torch.autograd.backward: grad_tensors\[0\] has shape \(4,\)",
                      torch.autograd.backward, y, torch.ones(4))
        assert msg.startswith("torch.autograd.backward: ")
        (g,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(g, torch.full((4,), 20.0))


def test_checked_func_vjp_pullback():
    x = torch.randn(4)
    with tv.checked():
        out, vjp_fn = torch.func.vjp(torch.sin, x)
        msg = _raises(r"torch.func.vjp: vjp_fn\(cotangents\): cotangents has shape \(3,\), but "
                      r"out has shape \(4,\)", vjp_fn, torch.ones(3))
        assert msg.startswith("torch.func.vjp: ")
        (g,) = vjp_fn(torch.ones(4))
        torch.testing.assert_close(g, x.cos())
        out, vjp_fn = torch.func.vjp(lambda t: {"a": t.sin(), "b": t.cos()}, x)
        msg = _raises(r"cotangents must have the same structure as the function's output",
                      vjp_fn, (torch.ones(4), torch.ones(4)))
        assert "{'a': Tensor(4,), 'b': Tensor(4,)}" in msg and "tree_map" in msg
        _raises(r"cotangents\['b'\] has shape \(2,\), but outputs\['b'\] has shape \(4,\)",
                vjp_fn, {"a": torch.ones(4), "b": torch.ones(2)})


def test_checked_func_vjp_pullback_with_none_for_a_non_scalar_output():
    # None stands for 1 only where the output is a scalar: a note, not torch's bare error
    x = torch.randn(4)
    with tv.checked():
        _, vjp_fn = torch.func.vjp(torch.sin, x)
        msg = _raises(r"out has shape \(4,\) \(4 elements\), and no cotangents was given",
                      vjp_fn, None)
        assert "torch.ones_like(out)" in msg
        _, vjp_fn = torch.func.vjp(lambda t: (t.sin(), t.sum()), x)
        _raises(r"outputs\[0\] has shape \(4,\) \(4 elements\), and no cotangents\[0\]",
                vjp_fn, (None, None))
        (g,) = vjp_fn((torch.ones(4), None))  # the scalar's None is torch's implicit 1
        torch.testing.assert_close(g, x.cos() + 1)


def test_checked_restores_torch_and_nests():
    originals = (torch.autograd.grad, torch.autograd.backward, torch.func.vjp)
    with tv.checked():
        with tv.checked():
            assert torch.autograd.grad is not originals[0]
        assert autograd.is_checked()
    assert (torch.autograd.grad, torch.autograd.backward, torch.func.vjp) == originals
    # Tensor.backward's wrapper stays (NOTE [wrappers of class attributes stay]) and, outside
    # a checked scope, is torch's: no check, torch's own error
    assert torch.Tensor.__dict__["backward"] is _checked_mode._checked_tensor_backward
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="Mismatch in shape") as info:
        (x * 2).backward(torch.ones(3))
    assert not isinstance(info.value, tv.GradOutputsError)
    with pytest.raises(tv.GradOutputsError):
        with tv.checked():
            x = torch.ones(2, requires_grad=True)
            (x * 2).backward(torch.ones(3))
    assert torch.autograd.grad is originals[0] and not autograd.is_checked()


def test_checked_as_decorator():
    @tv.checked()
    def step(x):
        assert autograd.is_checked()
        (x * 2).backward(torch.ones(5))

    with pytest.raises(tv.GradOutputsError, match=r"gradient has shape \(5,\)"):
        step(torch.ones(2, requires_grad=True))
    assert not autograd.is_checked()


def test_checked_as_decorator_without_parentheses():
    # as @torch.no_grad: this raised TypeError (checked() takes no arguments)
    @tv.checked
    def step(x):
        assert autograd.is_checked()
        (x * 2).backward(torch.ones(5))

    assert step.__name__ == "step"
    with pytest.raises(tv.GradOutputsError, match=r"gradient has shape \(5,\)"):
        step(torch.ones(2, requires_grad=True))
    assert not autograd.is_checked()

    @tv.checked
    def items():
        yield autograd.is_checked()

    assert list(items()) == [True] and not autograd.is_checked()
    with pytest.raises(TypeError, match=r"^torch_vjp.checked takes no arguments, but was given "
                       r"int 3: use it as `with tv.checked\(\):` or as a decorator"):
        tv.checked(3)


def test_checked_training_step_unchanged():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    data = torch.randn(16, 4), torch.randn(16, 2)
    grads = []
    for ctx in (None, tv.checked()):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data[0]), data[1])
        if ctx is None:
            loss.backward()
        else:
            with ctx:
                loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_environment_variable_turns_checking_on():
    code = (
        "import torch, torch_vjp\n"
        "x = torch.ones(4, requires_grad=True)\n"
        "try:\n"
        "    (x * 2).backward(torch.ones(3))\n"
        "except torch_vjp.GradOutputsError as e:\n"
        "    print('CHECKED', str(e).splitlines()[0])\n"
    )
    env = dict(os.environ, TORCH_VJP_CHECKED="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("CHECKED Mismatch in shape: grad_output[0] has a shape of torch.Size([3]) and "
            "output[0] has a shape of torch.Size([4]).") in out.stdout


def test_err_vector_for_scalar_output_in_backward():
    # seed 004, example 2: a (3,) "gradients" vector for a 0-d y.
    a = torch.tensor(0.1, requires_grad=True)
    y = 3 * a + 2 * a * a
    msg = _raises(r"torch_vjp.backward: grad_tensors\[0\] has shape \(3,\), but tensors\[0\] has "
                  r"shape \(\)", tv.backward, y, torch.tensor([0.1, 1.0, 0.0001]))
    assert msg.startswith("torch_vjp.backward: ")
    assert "so dL/d tensors[0] is a single number, not 3" in msg
    assert "backward has no batched form" in msg and "is_grads_batched=True\n" not in msg


def test_err_pullback_names_the_primal_shape():
    x = torch.randn(4)
    with tv.checked():
        out, vjp_fn = torch.func.vjp(lambda t: torch.outer(t, t), x)
    msg = _raises(r"cotangents has shape \(4,\), but out has shape \(4, 4\)", vjp_fn, torch.ones(4))
    assert "(4,) is the shape of primals[0]" in msg


# --------------------------------------------------------------------------------------
# The four messages of the seeds' follow-up review (issue #12, item 6)
# --------------------------------------------------------------------------------------


def test_integer_gradient_warning_never_suggests_an_integer_output():
    """Integer tensors cannot require grad: the cast warning must not suggest computing the
    output in the integer dtype, only the explicit cast."""
    x = torch.randn(3, requires_grad=True)
    with pytest.warns(tv.GradOutputsWarning) as caught:
        tv.grad(x * 2, x, torch.ones(3, dtype=torch.int64))
    (message,) = [str(w.message) for w in caught]
    assert message.endswith("Pass grad_outputs[0].to(torch.float32) to make the cast explicit.")
    assert "compute" not in message and "int64 if you need" not in message


def test_one_element_output_given_several_weights_is_diagnosed():
    x = torch.randn(1, requires_grad=True)
    msg = _raises(r"grad_outputs\[0\] has shape \(3,\), but outputs\[0\] has shape \(1,\)",
                  tv.grad, x * 2, x, torch.ones(3))
    assert "a single element, so dL/d outputs[0] is a single number, not 3" in msg
    assert "torch.ones_like(outputs[0]), or leave it None" in msg
    assert "differentiate the vector of those outputs" in msg


def test_batched_shape_names_k_apart_from_the_output_shape():
    """With K known from another entry, the wanted shape is '(K, 4, 4) with K = 4', never a
    shape that reads as (4, 4, 4) being required of the wrong entry alone."""
    x = torch.randn(4, 4, requires_grad=True)
    y = x * 2
    msg = _raises(r"grad_outputs\[1\] has shape \(4, 4\)", tv.grad, [y, y * 3], x,
                  [torch.ones(4, 4, 4), torch.ones(4, 4)], is_grads_batched=True)
    assert "must have shape (K, 4, 4) with K = 4, as in the other grad_outputs" in msg
    assert "grad_outputs[1].expand(4, *outputs[1].shape)" in msg


def test_missing_size_one_leading_dimension_is_an_unsqueeze():
    """A size-1 leading dimension is not 'the same vector for every row': one row only."""
    x = torch.randn(1, 3, requires_grad=True)
    msg = _raises(r"grad_outputs\[0\] has shape \(3,\), but outputs\[0\] has shape \(1, 3\)",
                  tv.grad, x * 2, x, torch.ones(3))
    assert "lacks the leading dimension of size 1 that outputs[0] has: pass " \
           "grad_outputs[0].unsqueeze(0)" in msg
    assert "same vector for every row" not in msg


def test_err_square_output_names_both_readings_of_a_vector():
    # a (B,) vector of per-example weights for a (B, B) output matches both the output's
    # leading dimension and its last; it was told only to expand_as, which weights the
    # columns: a wrong gradient, without a word, for the per-row reading
    x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    y = x.tanh()
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    msg = _raises(r"grad_outputs\[0\] has shape \(3,\), but outputs\[0\] has shape \(3, 3\)",
                  tv.grad, y, x, w, retain_graph=True)
    assert "pass grad_outputs[0].expand_as(outputs[0])" in msg
    assert "pass grad_outputs[0].reshape((3, 1)).expand_as(outputs[0])" in msg
    (g,) = tv.grad(y, x, w.reshape(3, 1).expand_as(y))
    jac = torch.func.jacrev(torch.tanh)(x.detach())
    torch.testing.assert_close(g, torch.einsum("b,bkij->ij", w, jac))


def test_err_output_cut_off_where_only_some_inputs_require_grad_is_told_both():
    # inputs[0] requires grad and outputs[0] was computed from it under torch.no_grad(); the
    # message told only to 'create the inputs with requires_grad=True', which inputs[0] was
    p = torch.randn(4, requires_grad=True)
    w = torch.randn(4)
    with torch.no_grad():
        z = p * 3
    msg = _raises(r"element 0 of tensors does not require grad", tv.grad, z, [p, w],
                  torch.ones(4))
    assert "inputs[1] does not require grad, but the other inputs do" in msg
    assert "the graph was cut on the way" in msg
    assert "create the inputs with requires_grad=True" not in msg


@pytest.mark.parametrize("bad,what", [(None, "None"), (3.0, "a float")])
def test_an_output_that_is_not_a_tensor_is_explained_under_torchs_sentence(bad, what):
    # (for None, the fix was 'pass the tensor itself (.item() gives a number ...)', about a
    # number and a tensor the caller never had: it now says to leave the entry out)
    # tv.grad([y, None], ...) raised torch's bare AssertionError "Expected output to be a
    # torch.Tensor" with no word on which output or why (check_grad_outputs explains it)
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 2
    calls = [
        ("torch_vjp.grad", "outputs", lambda: tv.grad([y, bad], x, [torch.ones(4, 3), None])),
        ("torch_vjp.backward", "tensors",
         lambda: tv.backward([y, bad], [torch.ones(4, 3), None])),
    ]
    for call, name, run in calls:
        with pytest.raises(AssertionError) as info:  # (torch's class and sentence, kept)
            run()
        assert str(info.value) == "Expected output to be a torch.Tensor"
        fix = (f"Fix: leave {name}[1] out of {name}, and its entry out of "
               f"{'grad_outputs' if name == 'outputs' else 'grad_tensors'}: None holds "
               f"nothing to differentiate." if bad is None else
               "Fix: pass the tensor itself (.item() gives a number, which holds no graph).")
        assert info.value.__notes__ == [
            f"{call}: {name}[1] is {what}, but each entry of {name} must be a tensor (or a "
            f"GradientEdge of one).\n  {name} are the outputs y whose vector-Jacobian product "
            f"is taken, tensors computed from ones that require grad. {fix}"]
    assert x.grad is None


def test_a_dict_of_grad_outputs_is_named_as_a_dict():
    # torch reads a dict as its keys; the explanation said only "grad_outputs[0] is a str",
    # which the caller never passed
    x = torch.randn(4, 3, requires_grad=True)
    y = x * 2
    for call, go, out, run in [
        ("torch_vjp.grad", "grad_outputs", "outputs",
         lambda: tv.grad(y, x, {"a": torch.ones(4, 3)})),
        ("torch_vjp.backward", "grad_tensors", "tensors",
         lambda: tv.backward([y], {"a": torch.ones(4, 3)})),
    ]:
        with pytest.raises(tv.GradOutputsTypeError) as info:
            run()
        assert str(info.value) == "gradients can be either Tensors or None, but got str"
        assert info.value.__notes__ == [
            f"{call}: {go} is a dict, and torch reads a dict as the sequence of its keys: "
            f"{go}[0] is its key 'a', a str, not a gradient.\n  {go} holds one entry per entry "
            f"of {out}, in the same order: a tensor of that output's shape (None for a scalar "
            f"output). Fix: pass a list, e.g. list({go}.values()) if the dict's values are in "
            f"the order of {out}."]
    with tv.checked(), pytest.raises(tv.GradOutputsTypeError) as info:
        y.backward({"a": torch.ones(4, 3)})
    assert info.value.__notes__[0].endswith(
        "gradient is dL/dy, one tensor of y's shape. Fix: pass that tensor itself, not a dict "
        "holding it.")
    # a dict whose keys are tensors is read as torch reads it
    assert torch.equal(tv.grad(y, x, {torch.ones(4, 3): 1})[0], torch.full((4, 3), 2.0))


def test_a_shape_no_hint_explains_still_gets_a_fix():
    # a grad_output of an unrelated shape, or of the output's shape twice (an identity basis
    # for the Jacobian), was told only that its shape was wrong: no fix
    x = torch.randn(4, 3, requires_grad=True)
    y = x.sin()
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y, x, torch.ones(5, 7))
    assert info.value.__notes__[0].endswith(
        "so it must have shape (4, 3).\n  Fix: pass a tensor of outputs[0]'s shape (4, 3) as "
        "grad_outputs[0], e.g. torch.ones_like(outputs[0]) to differentiate the sum of "
        "outputs[0]'s elements.")
    basis = torch.eye(12).reshape(4, 3, 4, 3)
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y, x, basis, retain_graph=True)
    assert info.value.__notes__[0].endswith(
        "(4, 3, 4, 3) is outputs[0]'s shape twice, the shape of the Jacobian of outputs[0] "
        "with respect to itself (an identity basis, one vector per element of outputs[0]?). "
        "For the Jacobian, torch_vjp.jacobian_of computes it; to use these vectors, one "
        "vector-Jacobian product each, pass grad_outputs[0].reshape(-1, *outputs[0].shape) "
        "and is_grads_batched=True.")
    # (the fix it gives works)
    (jac,) = tv.grad(y, x, basis.reshape(-1, *y.shape), is_grads_batched=True)
    torch.testing.assert_close(jac.reshape(4, 3, 4, 3), torch.diag(x.detach().cos().reshape(
        -1)).reshape(4, 3, 4, 3))
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y.sum(), x, torch.ones(4, 1), is_grads_batched=True)
    assert info.value.__notes__[0].endswith(
        "Fix: make grad_outputs[0] torch.stack([v1, v2, ...]) of K vectors, each of "
        "outputs[0]'s shape ().")


def test_an_identity_basis_passed_batched_is_recognised():
    # with is_grads_batched=True (or vjp_fn's batched=True) the basis torch.eye(12).reshape(
    # 4, 3, 4, 3) got only 'make it torch.stack([v1, v2, ...])', where the unbatched call
    # named the basis and its reshape
    x = torch.randn(4, 3, requires_grad=True)
    y = x.sin()
    basis = torch.eye(12).reshape(4, 3, 4, 3)
    tail = ("(4, 3, 4, 3) is {o}'s shape twice, the shape of the Jacobian of {o} with respect "
            "to itself (an identity basis, one vector per element of {o}?). For the Jacobian, "
            "{whole} computes it; to use these vectors, one vector-Jacobian product each, pass "
            "{g}.reshape(-1, *{o}.shape), keeping {flag}=True: the K vectors go along one "
            "leading dimension.")
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y, x, basis, is_grads_batched=True, retain_graph=True)
    assert info.value.__notes__[0].endswith(tail.format(
        o="outputs[0]", g="grad_outputs[0]", whole="torch_vjp.jacobian_of",
        flag="is_grads_batched"))
    with pytest.raises(tv.GradOutputsError) as info:
        tv.vjp(torch.sin, x.detach())[1](basis, batched=True)
    assert str(info.value).endswith(tail.format(
        o="out", g="cotangents", whole="torch_vjp.jacobian(f, *primals)", flag="batched"))
    # (the fix it gives works; and a (3, 3) basis of a (3,) output is K = 3 products, valid)
    (jac,) = tv.grad(y, x, basis.reshape(-1, *y.shape), is_grads_batched=True)
    torch.testing.assert_close(jac.reshape(12, 12), torch.diag(x.detach().cos().reshape(-1)))
    v = torch.randn(3, requires_grad=True)
    tv.grad(v.sin(), v, torch.eye(3), is_grads_batched=True)


def test_a_number_as_gradient_of_tensor_backward_is_told_to_make_a_tensor():
    # y.backward(2.0) in checked mode was told "gradient ... must be a Tensor, a list or tuple
    # of Tensors ... It holds one vector dL/d output per entry of y": y.backward takes one
    # tensor, and the number the caller gave was not used in the fix
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()
    with tv.checked(), pytest.raises(tv.GradOutputsTypeError) as info:
        y.backward(2.0)
    assert info.value.__notes__ == [
        "y.backward(gradient): gradient is a float, but it must be a Tensor of y's shape, or "
        "None for a scalar y.\n  gradient is dL/dy: one number per element of y. Fix: "
        "torch.full_like(y, 2.0) to weight every element by 2.0."]
    with pytest.raises(tv.GradOutputsTypeError) as info:
        tv.grad(y, x, 2.0)
    assert info.value.__notes__[0].endswith(
        "Fix: pass a tensor, e.g. torch.full_like(outputs[0], 2.0) for a constant.")


def _jagged(lengths, inner=3, requires_grad=False):
    return torch.nested.nested_tensor([torch.randn(k, inner, dtype=torch.float64)
                                       for k in lengths], layout=torch.jagged,
                                      requires_grad=requires_grad)


_JAGGED_CALLS = {
    "tv.grad": lambda y, x, v: tv.grad(y, x, v),
    "tv.grad list": lambda y, x, v: tv.grad([y], [x], [v]),
    # (torch's own function, taken before the block: it hands the nested output's
    # __torch_function__ the function named torch.autograd.grad now, the wrapper)
    "torch's grad in a block": lambda y, x, v: _in_checked(torch.autograd.grad, y, x, v),
    # (the wrapper itself, looked up inside the block)
    "checked grad": lambda y, x, v: _in_checked(lambda: torch.autograd.grad(y, x, v)),
    "checked Tensor.backward": lambda y, x, v: _in_checked(y.backward, v),
    "checked backward": lambda y, x, v: _in_checked(lambda: torch.autograd.backward(y, v)),
    "tv.backward": lambda y, x, v: tv.backward(y, v),
}


def _in_checked(fn, *args):
    with tv.checked():
        return fn(*args)


@pytest.mark.parametrize("call", list(_JAGGED_CALLS))
@pytest.mark.parametrize("case", ["same lengths", "other lengths", "other inner", "dense"])
def test_a_vector_that_does_not_fit_a_jagged_output_is_explained(call, case):
    # torch's "Mismatch in shape: ... torch.Size([2, j4, 3]) and ... torch.Size([2, j1, 3])"
    # passed through bare, though the lengths were the same: a nested tensor built anew
    # gets a ragged dimension of its own. torch's class and sentence stay, with a note.
    x = _jagged([2, 3], requires_grad=True)
    y = x * 2
    v = {"same lengths": _jagged([2, 3]), "other lengths": _jagged([3, 2]),
         "other inner": _jagged([2, 3], inner=4),
         "dense": torch.ones(2, 3, dtype=torch.float64)}[case]
    with pytest.raises(RuntimeError, match=r"^Mismatch in shape: grad_output\[0\]") as info:
        _JAGGED_CALLS[call](y, x, v)
    # once: in a checked block the call comes back to the wrapper through the nested
    # tensor's __torch_function__, and the error passed both (the explanation twice)
    assert len(info.value.__notes__) == 1, info.value.__notes__
    note = info.value.__notes__[0]
    assert "torch compares a ragged dimension (j1, j2, ...) by the offsets tensor" in note
    assert ".offsets()), values of shape" in note and "Fix: build " in note, note
    said = {"same lengths": "'s lengths, (2, 3), but is not built on ",
            "other lengths": "is a jagged nested tensor of shape (2, lengths (3, 2), 3), ",
            "other inner": "is a jagged nested tensor of shape (2, lengths (2, 3), 4), ",
            "dense": "is a jagged nested tensor, and "}[case]
    assert said in note, note
    # the fix works: a vector on the output's offsets, or ones_like
    for fixed in (torch.nested.nested_tensor_from_jagged(
            torch.ones_like(y.values()), y.offsets()), torch.ones_like(y)):
        (g,) = tv.grad(x * 2, x, fixed)
        torch.testing.assert_close(g.values(), 2 * torch.ones_like(x.values()))


@pytest.mark.parametrize("call", list(_JAGGED_CALLS))
@pytest.mark.parametrize("case", ["none", "complex"])
def test_no_vector_or_a_complex_one_for_a_jagged_output_is_explained(call, case):
    # torch's "grad can be implicitly created only for scalar outputs" and its complex dtype
    # refusal reached the caller bare for a jagged output (a dense one gets the explanation)
    x = _jagged([2, 3], requires_grad=True)
    y = x * 2
    v = None if case == "none" else torch.ones_like(y, dtype=torch.complex128)
    sentence = {"none": r"^grad can be implicitly created only for scalar outputs",
                "complex": r"^For complex Tensors, both grad_output and output are required "
                           r"to have the same dtype"}[case]
    with pytest.raises(RuntimeError, match=sentence) as info:
        _JAGGED_CALLS[call](y, x, v)
    assert len(info.value.__notes__) == 1, info.value.__notes__
    note = info.value.__notes__[0]
    if case == "none":
        named = re.search(r": (\S+) is a jagged nested tensor, and no \S+ was given", note)
        assert named, note
        o = named.group(1)  # (outputs[0], tensors[0] or y, as the call names it)
        assert "a nested tensor is never one" in note, note
        assert f"pass torch.ones_like({o})" in note and f"{o}.values().sum()" in note, note
    else:
        assert "has dtype torch.complex128, but " in note and "has dtype torch.float64" in note
        assert "never between complex and real" in note, note
    # the fixes work
    (g,) = tv.grad(x * 2, x, torch.ones_like(y))
    torch.testing.assert_close(g.values(), 2 * torch.ones_like(x.values()))
    (g,) = tv.grad((x * 2).values().sum(), x)
    torch.testing.assert_close(g.values(), 2 * torch.ones_like(x.values()))


@pytest.mark.parametrize("call", ["tv.grad", "checked grad", "checked backward"])
def test_a_number_beside_a_jagged_output_is_explained_once(call):
    x = _jagged([2, 3], requires_grad=True)
    y = x * 2
    run = {"tv.grad": lambda: tv.grad([y, 1.0], x, [torch.ones_like(y), None]),
           "checked grad": lambda: _in_checked(lambda: torch.autograd.grad(
               [y, 1.0], x, [torch.ones_like(y), None])),
           "checked backward": lambda: _in_checked(lambda: torch.autograd.backward(
               [y, 1.0], [torch.ones_like(y), None]))}[call]
    with pytest.raises(AssertionError, match="^Expected output to be a torch.Tensor") as info:
        run()
    assert len(info.value.__notes__) == 1, info.value.__notes__
    assert "outputs[1]" in info.value.__notes__[0] or "tensors[1]" in info.value.__notes__[0]


def test_an_error_in_a_jagged_graph_of_the_user_s_own_passes_through():
    # (the note is for torch's check of the vector, not for a shape error of a backward)
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("Mismatch in shape: grad_output[0] mine")

    x = _jagged([2, 3], requires_grad=True)
    with pytest.raises(RuntimeError, match="mine") as info:
        tv.grad(Bad.apply(x), x, torch.ones_like(x))
    assert not getattr(info.value, "__notes__", None)
