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


# --------------------------------------------------------------------------------------
# is_grads_batched with GradientEdge outputs
# --------------------------------------------------------------------------------------


def _edges():
    from torch.autograd.graph import get_gradient_edge

    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    a, b = _f(x)
    return x, (a, b), (get_gradient_edge(a), get_gradient_edge(b))


_BATCHED_EDGE_MISTAKES = {
    # (the vectors, torch's sentence, what the explanation says)
    "unbatched": (lambda: (torch.ones(2, 3, dtype=F64), torch.ones(3, 3, dtype=F64)),
                  "If `is_grads_batched=True`, we interpret the first dimension",
                  "grad_outputs[1] has shape (3, 3)"),
    "other batch sizes": (lambda: (torch.ones(2, 3, dtype=F64), torch.ones(3, 3, 3, dtype=F64)),
                          "vmap: Expected all tensors to have the same size",
                          "(grad_outputs[0]: 2, grad_outputs[1]: 3)"),
    "None": (lambda: (torch.ones(2, 3, dtype=F64), None),
             "grad can be implicitly created only for scalar outputs",
             "grad_outputs[1] is None, but is_grads_batched=True"),
}


@pytest.mark.parametrize("case", list(_BATCHED_EDGE_MISTAKES))
def test_batched_vectors_of_gradient_edges_are_checked(case):
    # GradientEdge outputs with is_grads_batched=True went to torch unchecked: a vector
    # without its batch dimension was told "Batched grads are not supported with
    # GradientEdge" (they are: torch computes the valid call), other batch sizes came back
    # as a bare vmap ValueError, a None as "grad can be implicitly created only for scalar
    # outputs"
    make, sentence, said = _BATCHED_EDGE_MISTAKES[case]
    x, _, edges = _edges()
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(edges, x, make(), is_grads_batched=True)
    assert str(info.value).startswith(sentence), str(info.value)
    assert said in info.value.explanation, info.value.explanation


def test_a_batched_vector_torch_casts_for_a_leaf_s_edge_is_told():
    # (a float64 batch for a float32 leaf: torch rounds it without a word, as unbatched)
    from torch.autograd.graph import get_gradient_edge

    x = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    v = torch.tensor([[1.0, 2.0, 3.0], [0.25, 0.5, 4.0]], dtype=F64)
    with pytest.warns(tv.GradOutputsWarning, match="casts"):
        (got,) = tv.grad(get_gradient_edge(x), x, v, is_grads_batched=True)
    (ref,) = torch.autograd.grad(x, x, v.to(torch.float32), is_grads_batched=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_valid_batched_vectors_of_gradient_edges_are_torch_s():
    x, (a, b), edges = _edges()
    v = (torch.randn(4, 3, dtype=F64), torch.randn(4, 3, 3, dtype=F64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (got,) = tv.grad(edges, x, v, is_grads_batched=True, retain_graph=True)
    j0, j1 = jacrev(_f)(x.detach())
    expected = torch.einsum("ka,ab->kb", v[0], j0) + torch.einsum("kab,abc->kc", v[1], j1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    (ref,) = torch.autograd.grad((a, b), x, v, is_grads_batched=True)
    assert torch.equal(got, ref)


# --------------------------------------------------------------------------------------
# An integer vector for a leaf that keeps its gradient's dtype
# --------------------------------------------------------------------------------------

_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


def _keeping_leaf():
    leaf = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    leaf.grad_dtype = None
    return leaf


def _checked_tensor_backward(t, v):
    with tv.checked():
        t.backward(v)


_LEAF_CALLS = {
    "tv.grad": lambda t, v: tv.grad(t, t, v),
    "tv.grad edge": lambda t, v: tv.grad(_edge(t), t, v),
    "tv.grad batched": lambda t, v: tv.grad(t, t, v.expand(2, 3), is_grads_batched=True),
    "tv.backward": lambda t, v: tv.backward(t, v),
    "tv.grad Logged": lambda t, v: tv.grad(t, t, v.as_subclass(Logged)),
    "checked Tensor.backward": _checked_tensor_backward,
}


def _edge(t):
    from torch.autograd.graph import get_gradient_edge

    return get_gradient_edge(t)


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=["int64", "bool"])
@pytest.mark.parametrize("call", list(_LEAF_CALLS))
def test_an_integer_vector_for_a_leaf_that_keeps_its_dtype_is_explained(call, dtype):
    # grad_dtype = None: torch keeps the leaf's gradient in the vector's dtype, and its
    # engine met an integer vector with "isDifferentiableType(grad.scalar_type()) INTERNAL
    # ASSERT FAILED ... please report a bug to PyTorch", after torch_vjp warned that torch
    # casts it to the leaf's dtype (it does not)
    leaf = _keeping_leaf()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(tv.GradOutputsError) as info:
            _LEAF_CALLS[call](leaf, torch.ones(3, dtype=dtype))
    msg = str(info.value)
    assert "INTERNAL ASSERT" not in msg, msg
    kind = "a boolean" if dtype == torch.bool else "an integer"
    assert f"has dtype {dtype}, but " in msg and "is a leaf whose grad_dtype is None" in msg
    assert f"{kind} tensor cannot hold a gradient" in msg, msg
    assert ".to(torch.float64)" in msg, msg
    assert leaf.grad is None


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("call", list(_LEAF_CALLS))
def test_the_fix_of_an_integer_vector_for_a_keeping_leaf_works(call):
    leaf = _keeping_leaf()
    got = _LEAF_CALLS[call](leaf, torch.ones(3, dtype=torch.int64).to(F64))
    got = leaf.grad if got is None else got[0]
    assert got.dtype == F64
    torch.testing.assert_close(got, torch.ones_like(got), rtol=0, atol=0)


@pytest.mark.parametrize("call", list(_LEAF_CALLS))
def test_an_integer_vector_for_a_leaf_torch_casts_is_torch_s(call):
    # (a leaf of the default grad_dtype: torch casts the vector to the leaf's dtype, and
    # torch_vjp says so)
    leaf = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    with pytest.warns(tv.GradOutputsWarning, match="torch casts the integer"):
        got = _LEAF_CALLS[call](leaf, torch.tensor([1, 2, 3]))
    got = leaf.grad if got is None else got[0]
    assert got.dtype == F64
    ref = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    torch.testing.assert_close(got if got.dim() == 1 else got[0], ref, rtol=0, atol=0)


# --------------------------------------------------------------------------------------
# An input that does not require grad
# --------------------------------------------------------------------------------------


def _frozen_case():
    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    c = torch.tensor([1.0, 2.0, 3.0], dtype=F64)  # (no requires_grad)
    return x, c, (x * c).sum() + (c * c).sum()


_FROZEN_CALLS = {
    "tv.grad": lambda y, x, c: tv.grad(y, [x, c]),
    "allow_unused": lambda y, x, c: tv.grad(y, [x, c], allow_unused=True),
    "materialize_grads": lambda y, x, c: tv.grad(y, [x, c], materialize_grads=True),
    "is_grads_batched": lambda y, x, c: tv.grad(y, [x, c], torch.ones(2, dtype=F64),
                                                is_grads_batched=True),
    "Logged": lambda y, x, c: tv.grad(y.as_subclass(Logged), [x, c]),
    "checked grad": lambda y, x, c: _in_checked(lambda: torch.autograd.grad(y, [x, c])),
    "tv.backward": lambda y, x, c: tv.backward(y, inputs=[x, c]),
    "checked Tensor.backward": lambda y, x, c: _in_checked(lambda: y.backward(inputs=[x, c])),
}


def _in_checked(fn):
    with tv.checked():
        return fn()


@pytest.mark.parametrize("call", list(_FROZEN_CALLS))
def test_an_input_that_does_not_require_grad_is_explained(call):
    # torch's "One of the differentiated Tensors does not require grad" (and, for
    # backward's inputs, "can't retain_grad on Tensor that has requires_grad=False") came
    # back bare: which input, and what to do, untold
    x, c, y = _frozen_case()
    with pytest.raises(tv.GradOutputsError) as info:
        _FROZEN_CALLS[call](y, x, c)
    sentence = ("can't retain_grad on Tensor that has requires_grad=False"
                if "backward" in call else
                "One of the differentiated Tensors does not require grad")
    assert str(info.value).startswith(sentence), str(info.value)
    note = info.value.explanation
    assert "inputs[1] (shape (3,)) does not require grad" in note, note
    assert "inputs[1].requires_grad_()" in note and "leave it out of inputs" in note, note
    # (allow_unused is a parameter of grad only)
    assert ("allow_unused=True does not help" in note) == ("backward" not in call), note
    assert x.grad is None


def test_the_fix_for_an_input_that_does_not_require_grad_works():
    x, c, _ = _frozen_case()
    c.requires_grad_()
    y = (x * c).sum() + (c * c).sum()
    got = tv.grad(y, [x, c])
    ref = jacrev(lambda a, b: (a * b).sum() + (b * b).sum(), argnums=(0, 1))(
        x.detach(), c.detach())
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_frozen_parameters_among_the_inputs_are_named_and_filtered_in_the_fix():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model.double()
    model[0].requires_grad_(False)
    loss = model(torch.ones(5, 3, dtype=F64)).pow(2).sum()
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(loss, model.parameters())
    note = info.value.explanation
    assert "inputs[0] (shape (4, 3)) and inputs[1] (shape (4,)) do not require grad" in note
    assert "[t for t in inputs if t.requires_grad]" in note, note
    fixed = tv.grad(loss, [p for p in model.parameters() if p.requires_grad])
    assert len(fixed) == 2 and fixed[0].shape == (2, 4)


def test_an_input_of_a_dict_that_does_not_require_grad_is_named_by_its_key():
    x, c, y = _frozen_case()
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(y, {"x": x, "c": c})
    assert "inputs['c'] (shape (3,)) does not require grad" in info.value.explanation


def test_the_same_sentence_from_the_user_s_backward_passes_through():
    class Own(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("One of the differentiated Tensors does not require grad")

    x = torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        tv.grad(Own.apply(x).sum(), x)
    assert not isinstance(info.value, tv.TorchVJPError)


# --------------------------------------------------------------------------------------
# Several mistakes at once: which is told
# --------------------------------------------------------------------------------------
#
# The order: the number of vectors first (with fewer vectors than outputs, an entry cannot
# be matched to its output, so comparing entry i with outputs[i] misleads); then the
# outputs in index order, the first whose vector has any mistake: a None where a vector is
# needed, not a tensor, its shape, its dtype (complex against real), its device, its
# layout, every other mistake of that same vector told with it; then the batch sizes; then
# the outputs that do not require grad.


def _two():
    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    a, b = _f(x)
    return x, a, b


def _diagnosis(*args, **kwargs):
    with pytest.raises(tv.GradOutputsError) as info:
        tv.grad(*args, **kwargs)
    return str(info.value), info.value.explanation


def test_a_missing_vector_is_told_as_a_count_not_as_a_wrong_shape():
    # (3, 3) given alone for outputs (3,) and (3, 3): the vector of outputs[0] is missing,
    # and grad_outputs[0] fits outputs[1]. It was told "grad_outputs[0] has shape (3, 3),
    # but outputs[0] has shape (3,) ... must have shape (3,)", a fix that leaves outputs[1]
    # without a vector
    x, a, b = _two()
    sentence, note = _diagnosis((a, b), x, (torch.ones(3, 3, dtype=F64),))
    assert sentence == "got 2 tensors and 1 gradients", sentence
    assert "got 2 outputs but 1 grad_outputs" in note, note
    assert "grad_outputs[0] has the shape of outputs[1], (3, 3)" in note, note
    assert "the vector of outputs[0] is missing" in note, note


def test_too_few_vectors_of_the_wrong_shape_are_told_as_a_count():
    x, a, b = _two()
    sentence, note = _diagnosis((a, b), x, (torch.ones(4, dtype=F64),))
    assert sentence == "got 2 tensors and 1 gradients", sentence
    assert "is missing" not in note, note  # (nothing fits: no guess)


def test_a_wrong_shape_and_a_complex_dtype_of_one_vector_are_both_told():
    x, a, b = _two()
    sentence, note = _diagnosis(a, x, torch.ones(4, dtype=torch.complex128))
    assert sentence.startswith("Mismatch in shape: grad_output[0]"), sentence
    assert "grad_outputs[0] has shape (4,), but outputs[0] has shape (3,)" in note, note
    assert "grad_outputs[0] has more to fix: it has dtype torch.complex128, but outputs[0] " \
        "has dtype torch.float64 (a real output takes a real vector: .real)" in note, note


def test_a_wrong_shape_and_device_of_one_vector_are_both_told():
    x, a, b = _two()
    sentence, note = _diagnosis(a, x, torch.ones(4, dtype=F64, device="meta"))
    assert sentence.startswith("Mismatch in shape: grad_output[0]"), sentence
    assert "grad_outputs[0] has more to fix: it is on meta, but outputs[0] is on cpu " \
        "(.to(outputs[0].device))" in note, note


def test_a_complex_dtype_and_a_device_of_one_vector_are_both_told():
    x, a, b = _two()
    sentence, note = _diagnosis(a, x, torch.ones(3, dtype=torch.complex128, device="meta"))
    assert sentence.startswith("For complex Tensors"), sentence
    assert "it is on meta, but outputs[0] is on cpu" in note, note
    assert "has dtype torch.complex128, but outputs[0] has dtype" in note


def test_the_first_output_with_a_mistake_is_told_whatever_the_mistakes():
    # a device mistake of outputs[0] and a shape mistake of outputs[1]: outputs[0]'s was
    # passed over for outputs[1]'s (torch checks every shape before any device)
    x, a, b = _two()
    sentence, note = _diagnosis((a, b), x, (torch.ones(3, dtype=F64, device="meta"),
                                           torch.ones(3, dtype=F64)))
    assert sentence.startswith("invalid gradient at index 0 - expected device cpu but got "
                               "meta"), sentence
    assert "grad_outputs[0] is on device meta, but outputs[0] is on cpu" in note, note


def test_a_single_mistake_is_told_alone():
    x, a, b = _two()
    _, note = _diagnosis(a, x, torch.ones(4, dtype=F64))
    assert "more to fix" not in note, note


def test_combined_mistakes_in_batched_vectors():
    x, a, b = _two()
    # (other batch sizes, and the second vector without its batch dimension: the shape of
    # the first output in index order with a mistake is told)
    sentence, note = _diagnosis((a, b), x, (torch.ones(2, 3, dtype=F64),
                                           torch.ones(3, 3, dtype=torch.complex128)),
                                is_grads_batched=True)
    assert sentence.startswith("If `is_grads_batched=True`"), sentence
    assert "grad_outputs[1] has shape (3, 3)" in note, note
    assert "it has dtype torch.complex128, but outputs[1] has dtype torch.float64" in note


# --------------------------------------------------------------------------------------
# Nested tensors of the strided layout
# --------------------------------------------------------------------------------------


def _strided_nested(*shapes, dtype=F64, requires_grad=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's note that the layout is a prototype)
        return torch.nested.nested_tensor([torch.ones(*s, dtype=dtype) for s in shapes],
                                          requires_grad=requires_grad)


@pytest.mark.parametrize("case", ["other shapes", "dense"])
@pytest.mark.parametrize("call", ["tv.grad", "tv.backward"])
def test_a_vector_that_does_not_fit_a_strided_nested_output_is_explained(call, case):
    # torch_vjp's own note for a jagged output was tried on a strided one, and failed with
    # "AttributeError: 'Tensor' object has no attribute 'offsets'"; a dense vector got
    # torch's bare "Expected both self and other to be nested tensors"
    x = _strided_nested((2, 3), (4, 3), requires_grad=True)
    y = x * 2
    v = (_strided_nested((2, 3), (3, 3)) if case == "other shapes"
         else torch.ones(2, 3, dtype=F64))
    with pytest.raises(RuntimeError) as info:
        tv.grad(y, x, v) if call == "tv.grad" else tv.backward(y, v)
    assert not isinstance(info.value, AttributeError)
    sentence = ("Mismatch in shape: grad_output[0]" if case == "other shapes"
                else "Expected both self and other to be nested tensors")
    assert str(info.value).startswith(sentence), str(info.value)
    (note,) = info.value.__notes__
    o = "outputs[0]" if call == "tv.grad" else "tensors[0]"
    assert f"{o} is a nested tensor of 2 tensors of shapes (2, 3), (4, 3)" in note, note
    said = ("a nested tensor of 2 tensors of shapes (2, 3), (3, 3)" if case == "other shapes"
            else "a dense tensor of shape (2, 3)")
    assert said in note, note
    assert f"torch.ones_like({o})" in note, note
    (g,) = tv.grad(x * 2, x, torch.ones_like(y))  # the fix
    for got, shape in zip(g.unbind(), [(2, 3), (4, 3)]):
        torch.testing.assert_close(got, torch.full(shape, 2.0, dtype=F64))


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("vector", ["float64", "None"])
@pytest.mark.parametrize("call", list(_LEAF_CALLS))
def test_a_leaf_whose_grad_dtype_is_an_integer_is_explained(call, vector):
    # torch lets a leaf's grad_dtype be an integer dtype, casts the gradient to it, and its
    # engine fails with an internal assert; torch_vjp first warned that torch "casts the
    # torch.float64 grad_outputs to torch.int64 silently"
    if vector == "None" and "batched" in call:
        pytest.skip("a batched call takes no None")
    leaf = torch.tensor(2.0 if vector == "None" else [0.5, -1.0, 2.0], dtype=F64,
                        requires_grad=True)
    leaf.grad_dtype = torch.int64
    v = None if vector == "None" else torch.ones(3, dtype=F64)
    if v is None and "Logged" in call:
        pytest.skip("(no vector to make a subclass of)")
    if v is None and "batched" not in call:
        run = {"tv.grad": lambda: tv.grad(leaf, leaf), "tv.grad edge": lambda: tv.grad(
            _edge(leaf), leaf), "tv.backward": lambda: tv.backward(leaf),
            "checked Tensor.backward": lambda: _checked_tensor_backward(leaf, None)}[call]
    else:
        run = lambda: _LEAF_CALLS[call](leaf, v)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(tv.GradOutputsError) as info:
            run()
    msg = str(info.value)
    assert "INTERNAL ASSERT" not in msg, msg
    assert "is a leaf whose grad_dtype is torch.int64: torch casts its gradient" in msg, msg
    assert ".grad_dtype to a floating-point dtype (its own, torch.float64), or to None" in msg


def test_an_override_that_computes_grad_itself_is_the_judge():
    # (a subclass whose __torch_function__ answers torch.autograd.grad its own way: what it
    # returns is returned, as from torch's own function, with the checker's word as a
    # warning where the checker disagrees)
    class Answers(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.autograd.grad:
                return (torch.zeros(3, dtype=F64),)
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.ones(3, dtype=F64, requires_grad=True)
    y = (x * 2).as_subclass(Answers)
    wrong = torch.ones(4, dtype=F64)
    (ref,) = torch.autograd.grad(y, x, wrong)
    with pytest.warns(tv.GradOutputsWarning, match="grad_outputs\\[0\\] has shape \\(4,\\)"):
        (got,) = tv.grad(y, x, wrong)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("call", ["tv.grad", "checked grad"])
def test_no_outputs_at_all_is_explained(call):
    # torch's engine finds the first input "not used in the graph" and suggests
    # allow_unused=True, which only gives None for every input
    x = torch.ones(3, dtype=F64, requires_grad=True)
    run = {"tv.grad": lambda: tv.grad([], x),
           "checked grad": lambda: _in_checked(lambda: torch.autograd.grad([], x))}[call]
    with pytest.raises(tv.GradOutputsError, match="^The differentiated Tensor at index 0") as info:
        run()
    assert "outputs is empty, so there is nothing to differentiate" in info.value.explanation
    # (what torch accepts stays torch's)
    assert tv.grad([], x, allow_unused=True) == (None,)
    (zeros,) = tv.grad([], x, materialize_grads=True)
    assert torch.equal(zeros, torch.zeros(3, dtype=F64))


# --------------------------------------------------------------------------------------
# A leaf inside the graph whose grad_dtype is an integer dtype
# --------------------------------------------------------------------------------------

_INNER_CALLS = {
    "tv.grad": lambda y, leaf: tv.grad(y, leaf, torch.ones(3, dtype=F64)),
    "tv.grad batched": lambda y, leaf: tv.grad(y, leaf, torch.ones(2, 3, dtype=F64),
                                               is_grads_batched=True),
    "tv.backward": lambda y, leaf: tv.backward(y, torch.ones(3, dtype=F64)),
    "tv.backward inputs": lambda y, leaf: tv.backward(y, torch.ones(3, dtype=F64),
                                                      inputs=[leaf]),
}


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
@pytest.mark.parametrize("call", list(_INNER_CALLS))
def test_a_leaf_in_the_graph_whose_grad_dtype_is_an_integer_is_explained(call):
    # the leaf is not an output: torch casts the gradient that reaches it to its integer
    # grad_dtype, and its engine fails with an internal assert, a bug report
    w = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    w.grad_dtype = torch.int64
    y = w * 3
    with pytest.raises(RuntimeError, match="INTERNAL ASSERT"):  # torch's own
        torch.autograd.grad(w * 3, w, torch.ones(3, dtype=F64))
    with pytest.raises(tv.GradOutputsError) as info:
        _INNER_CALLS[call](y, w)
    msg = str(info.value)
    assert "INTERNAL ASSERT" not in msg, msg
    said = ("a leaf tensor of shape (3,) that tensors depend on has grad_dtype torch.int64"
            if call == "tv.backward" else "inputs[0] is a leaf whose grad_dtype is torch.int64")
    assert f"{said}: torch casts its gradient to that dtype" in msg, msg
    fix = "that leaf's grad_dtype" if call == "tv.backward" else "inputs[0].grad_dtype"
    assert f"Fix: set {fix} to a floating-point dtype (its own, torch.float64), or to None" in msg
    # the fix
    w.grad_dtype = None
    (g,) = tv.grad(w * 3, w, torch.ones(3, dtype=F64))
    ref = jacrev(lambda t: t * 3)(w.detach()).sum(0)
    torch.testing.assert_close(g, ref)


@pytest.mark.skipif(not _HAS_GRAD_DTYPE, reason="this torch has no Tensor.grad_dtype")
def test_an_integer_grad_dtype_leaf_the_call_does_not_reach_is_torch_s():
    # (grad with respect to another input does not accumulate into the leaf)
    w = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    w.grad_dtype = torch.int64
    x = torch.tensor([1.0, 2.0, 3.0], dtype=F64, requires_grad=True)
    (g,) = tv.grad(w * x, x, torch.ones(3, dtype=F64))
    (ref,) = torch.autograd.grad(w * x, x, torch.ones(3, dtype=F64))
    assert torch.equal(g, ref)


# --------------------------------------------------------------------------------------
# An input the outputs do not depend on
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["detach", "no_grad", "item", "dict"])
def test_an_input_the_outputs_do_not_depend_on_is_explained(how):
    # torch's "The differentiated Tensor at index 1 appears to not have been used in the
    # graph. Set allow_unused=True" reached the caller bare (index 1 of a dict too), with no
    # word of the usual cause: the output computed from a detached copy of the input
    x = torch.tensor([0.5, -1.0, 2.0], dtype=F64, requires_grad=True)
    w = torch.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
    if how == "no_grad":
        with torch.no_grad():
            h = x * 2
    else:
        h = {"item": torch.tensor([t.item() for t in x], dtype=F64)}.get(how, x.detach() * 2)
    y = h.sum() + (w ** 2).sum()
    inputs = {"w": w, "x": x} if how == "dict" else [w, x]
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(y, inputs, retain_graph=True)
    with pytest.raises(tv.GradOutputsError,
                       match="^The differentiated Tensor at index 1 appears") as info:
        tv.grad(y, inputs, retain_graph=True)
    note = info.value.explanation
    name = "inputs['x']" if how == "dict" else "inputs[1]"
    assert f"torch_vjp.grad: {name} (shape (3,)) requires grad, but outputs do not depend on"\
        in note, note
    assert ".detach()" in note and "torch.no_grad()" in note and ".item()" in note, note
    assert "allow_unused=True" in note and "materialize_grads=True" in note, note
    # what the fixes give, as torch's own
    got = tv.grad(y, inputs, retain_graph=True, allow_unused=True)
    ref = torch.autograd.grad(y, inputs, retain_graph=True, allow_unused=True)
    got, ref = (list(got.values()), list(ref.values())) if how == "dict" else (got, ref)
    assert got[1] is None and ref[1] is None
    torch.testing.assert_close(got[0], 2 * w.detach())
    (zeros,) = tv.grad(y, [x], materialize_grads=True)
    assert torch.equal(zeros, torch.zeros(3, dtype=F64))


def test_an_unused_input_raised_by_the_user_s_backward_passes_through():
    class Says(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("The differentiated Tensor at index 0 appears to not have "
                               "been used in the graph (the user's own)")

    x = torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="the user's own") as info:
        tv.grad(Says.apply(x).sum(), x)
    assert not isinstance(info.value, tv.TorchVJPError)


# --------------------------------------------------------------------------------------
# inputs that are not tensors
# --------------------------------------------------------------------------------------


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1).double()


_BAD_INPUTS = {
    # case: (inputs from the model, torch's class, torch's sentence, what the note says)
    "named_parameters": (lambda m: m.named_parameters(), RuntimeError,
                         "all inputs have to be Tensors or GradientEdges, but got tuple",
                         "inputs[0] is a tuple ('weight', tensor): named_parameters() gives "
                         "(name, tensor) pairs"),
    "module": (lambda m: m, TypeError, "'Linear' object is not iterable",
               "inputs is a Linear, a module, not its tensors"),
    "method": (lambda m: m.parameters, TypeError, "'method' object is not iterable",
               "inputs is the method parameters itself, not what it returns"),
    "state_dict": (lambda m: m.state_dict(), TypeError, "`inputs` argument to `grad()` must "
                   "be a dict, not OrderedDict", "state_dict() holds detached tensors"),
    "nested": (lambda m: [list(m.parameters())], RuntimeError,
               "all inputs have to be Tensors or GradientEdges, but got list",
               "inputs[0] is a list, but inputs must be a flat sequence of tensors"),
    "int": (lambda m: [m.weight, 3], RuntimeError,
            "all inputs have to be Tensors or GradientEdges, but got int",
            "inputs[1] is an int, but each entry of inputs must be a tensor"),
}


@pytest.mark.parametrize("case", list(_BAD_INPUTS))
def test_inputs_that_are_not_tensors_are_explained(case):
    # torch's bare "'Linear' object is not iterable", "... but got tuple" (from
    # model.named_parameters()) reached the caller with no word of the fix
    make, cls, sentence, said = _BAD_INPUTS[case]
    m = _model()
    with pytest.raises(cls, match="^" + sentence.replace("(", r"\(").replace(")", r"\)")):
        torch.autograd.grad(m(torch.ones(2, dtype=F64)).sum(), make(m))
    with pytest.raises(cls, match="^" + sentence.replace("(", r"\(").replace(")", r"\)")) as info:
        tv.grad(m(torch.ones(2, dtype=F64)).sum(), make(m))
    assert isinstance(info.value, tv.TorchVJPError)
    note = info.value.explanation
    assert note.startswith("torch_vjp.grad: "), note
    assert said in note, note
    # the fix the note gives works, and is torch's
    fix = (dict(m.named_parameters()) if "dict(model.named_parameters())" in note
           else list(m.parameters()))
    got = tv.grad(m(torch.ones(2, dtype=F64)).sum(), fix)
    ref = torch.autograd.grad(m(torch.ones(2, dtype=F64)).sum(), fix)
    got, ref = (list(got.values()), list(ref.values())) if isinstance(fix, dict) else (got, ref)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)
    torch.testing.assert_close(got[0], torch.ones(1, 2, dtype=F64))


def test_a_non_tensor_input_of_backward_is_explained():
    m = _model()
    with pytest.raises(RuntimeError, match="^all inputs have to be Tensors or GradientEdges, "
                       "but got tuple") as info:
        tv.backward(m(torch.ones(2, dtype=F64)).sum(), inputs=m.named_parameters())
    assert "torch_vjp.backward: inputs[0] is a tuple ('weight', tensor)" in \
        info.value.explanation, info.value.explanation
