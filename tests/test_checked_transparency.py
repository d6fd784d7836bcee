"""Checked mode and the drop-ins change nothing for calls torch accepts (SPEC §1, §8).

NOTE [transparent checks] in ``torch_vjp._drop_ins``: torch's full signatures, any iterable
where torch takes one, torch's own sentence first for a call torch rejects, other code's
patches of torch left alone, a scope per thread, TorchScript and ``__torch_function__``
unaffected.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp import _checked_scope, autograd
from torch_vjp._errors import full_message


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _loss(model):
    return model(torch.ones(5, 3)).pow(2).sum()


# --------------------------------------------------------------------------------------
# Valid calls: the same result as torch, with any iterable and torch's signatures
# --------------------------------------------------------------------------------------

# Each case: (name, call(grad_fn, backward_fn, model)) returning what to compare.
def _grad_parameters_generator(grad, backward, model):
    return grad(_loss(model), model.parameters(), materialize_grads=True)


def _backward_inputs_generator(grad, backward, model):
    backward(_loss(model), inputs=model.parameters())
    return tuple(p.grad for p in model.parameters())


def _tensor_backward_inputs_generator(grad, backward, model):
    _loss(model).backward(inputs=model.parameters())
    return tuple(p.grad for p in model.parameters())


def _grad_outputs_generator(grad, backward, model):
    y = model(torch.ones(5, 3))
    return grad(y, list(model.parameters()), (g for g in [torch.ones(5, 2)]))


def _grad_outputs_deque(grad, backward, model):
    y = model(torch.ones(5, 3))
    return grad([y, y.sum()], list(model.parameters()),
                collections.deque([torch.ones(5, 2), None]))


def _grad_outputs_dict_values(grad, backward, model):
    y = model(torch.ones(5, 3))
    return grad(y, list(model.parameters()), {"y": torch.ones(5, 2)}.values())


def _backward_positional(grad, backward, model):
    x = torch.ones(2, requires_grad=True)
    # the positional form torch's own Tensor.backward uses
    backward((x * x).sum(), None, False, False, inputs=(x,))
    return (x.grad,)


def _backward_positional_grad_variables(grad, backward, model):
    x = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        backward(x * 3, None, None, False, torch.ones(2))
    return (x.grad,)


def _grad_only_inputs_positional(grad, backward, model):
    x = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return grad((x * x).sum(), x, None, None, False, False)


VALID = {
    "grad-inputs-parameters-generator": _grad_parameters_generator,
    "backward-inputs-parameters-generator": _backward_inputs_generator,
    "tensor-backward-inputs-generator": _tensor_backward_inputs_generator,
    "grad-outputs-generator": _grad_outputs_generator,
    "grad-outputs-deque": _grad_outputs_deque,
    "grad-outputs-dict-values": _grad_outputs_dict_values,
    "backward-positional-like-tensor-backward": _backward_positional,
    "backward-grad-variables-positional": _backward_positional_grad_variables,
    "grad-only-inputs-positional": _grad_only_inputs_positional,
}


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


@pytest.mark.parametrize("case", VALID, ids=list(VALID))
@pytest.mark.parametrize("how", ["drop-in", "checked", "plain"])
def test_valid_calls_match_torch(case, how):
    reference = VALID[case](torch.autograd.grad, torch.autograd.backward, _model())
    model = _model()
    if how == "drop-in":
        got = VALID[case](tv.grad, tv.backward, model)
    elif how == "checked":
        with tv.checked():
            got = VALID[case](torch.autograd.grad, torch.autograd.backward, model)
    else:
        got = VALID[case](torch.autograd.grad, torch.autograd.backward, model)
    _same(reference, got)


def test_grad_variables_warns_as_torch_does():
    x = torch.ones(2, requires_grad=True)
    with pytest.warns(FutureWarning, match="`grad_variables` is deprecated") as record:
        tv.backward(x * 3, grad_variables=torch.ones(2))
    assert record[0].filename == __file__  # points at the caller
    torch.testing.assert_close(x.grad, torch.full((2,), 3.0))


def test_only_inputs_false_warns_as_torch_does():
    x = torch.ones(2, requires_grad=True)
    with pytest.warns(FutureWarning, match="only_inputs argument is deprecated"):
        tv.grad((x * x).sum(), x, only_inputs=False)


def test_grad_tensors_and_grad_variables_both_raise_torch_sentence():
    x = torch.ones(2, requires_grad=True)
    for fn in (tv.backward, torch.autograd.backward):
        # (torch warns of the deprecated name before it raises)
        with pytest.warns(FutureWarning, match="`grad_variables` is deprecated"), \
                pytest.raises(RuntimeError, match="`grad_tensors` and `grad_variables` "
                              ".deprecated. arguments both passed"):
            fn(x * 3, torch.ones(2), grad_variables=torch.ones(2))
    with pytest.raises(tv.GradOutputsError, match="only one may be") as info:
        tv.backward(x * 3, torch.ones(2), grad_variables=torch.ones(2))
    assert str(info.value).startswith("`grad_tensors` and `grad_variables`")


def test_func_vjp_pullback_ignores_cotangent_of_unconnected_output_with_a_warning():
    x = torch.randn(4)
    const = torch.ones(3)
    f = lambda t: (t.sin(), const)  # noqa: E731 - the second output does not depend on t
    _, plain_fn = torch.func.vjp(f, x)
    (expected,) = plain_fn((torch.ones(4), torch.ones(7)))  # torch ignores the (7,) one
    with tv.checked():
        _, vjp_fn = torch.func.vjp(f, x)
        with pytest.warns(tv.GradOutputsWarning, match=r"(?s)cotangents\[1\] does not fit "
                          r"outputs\[1\], but torch ignores it: outputs\[1\] does not depend on "
                          r"the primals.*"
                          r"cotangents\[1\] has shape \(7,\), but outputs\[1\] has shape \(3,\)"):
            (got,) = vjp_fn((torch.ones(4), torch.ones(7)))
    torch.testing.assert_close(got, expected)


class _InterpolatedBackward(torch.autograd.Function):
    """A custom Function whose backward fails inside torch's own Python code."""

    @staticmethod
    def forward(t):
        return t * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return torch.nn.functional.interpolate(g, scale_factor=2)  # 1-d: torch raises


@pytest.mark.parametrize("first", [
    pytest.param(lambda t: torch.special.zeta(t, torch.tensor([2.0, 3.0, 4.0])),
                 id="missing-derivative"),
    pytest.param(_InterpolatedBackward.apply, id="backward-fails-in-torch-code"),
])
def test_func_vjp_pullback_passes_an_error_of_running_the_graph_through(first):
    # the cotangent of the constant output has the wrong shape, which torch ignores; torch
    # then failed for its own reason, and checked mode raised its shape error instead
    x = torch.randn(3) + 3
    f = lambda t: (first(t), torch.zeros(2))  # noqa: E731
    cotangents = (torch.ones(3), torch.zeros(5))
    with pytest.raises(Exception) as plain:
        torch.func.vjp(f, x)[1](cotangents)
    with tv.checked(), pytest.warns(tv.GradOutputsWarning, match=r"(?s)cotangents\[1\] does "
                                    r"not fit outputs\[1\], but torch ignores it.*has shape "
                                    r"\(5,\), but outputs\[1\] has shape \(2,\)"):
        with pytest.raises(Exception) as checked:
            torch.func.vjp(f, x)[1](cotangents)
    assert type(checked.value) is type(plain.value) is NotImplementedError
    assert str(checked.value) == str(plain.value)


def test_func_vjp_pullback_runs_normally_with_an_ignored_cotangent_of_another_type():
    x = torch.randn(3)
    f = lambda t: (t.sin(), torch.zeros(2))  # noqa: E731
    (expected,) = torch.func.vjp(f, x)[1]((torch.ones(3), 1.5))
    with tv.checked(), pytest.warns(tv.GradOutputsWarning, match=r"(?s)cotangents\[1\] does "
                                    r"not fit outputs\[1\], but torch ignores it.*"
                                    r"cotangents\[1\] is a float"):
        (got,) = torch.func.vjp(f, x)[1]((torch.ones(3), 1.5))
    torch.testing.assert_close(got, expected)


def test_func_vjp_pullback_still_rejects_a_connected_output_beside_an_ignored_one():
    x = torch.randn(3)
    f = lambda t: (torch.zeros(2), t.sin())  # noqa: E731
    with tv.checked(), pytest.warns(tv.GradOutputsWarning, match="torch ignores it"):
        with pytest.raises(tv.GradOutputsError, match=r"^Mismatch in shape: grad_output\[1\] "
                           r"has a shape of torch.Size\(\[4\]\)") as info:
            torch.func.vjp(f, x)[1]((torch.zeros(5), torch.ones(4)))
    assert "cotangents[1] has shape (4,), but outputs[1] has shape (3,)" in full_message(
        info.value)


def test_func_vjp_pullback_takes_none_for_an_unconnected_output_without_a_word():
    # torch.func takes None as the cotangent of an output that does not depend on the
    # primals; checked mode warned that torch accepted a mistake
    x = torch.randn(3)
    f = lambda t: (t.detach() * 2, t.sum())  # noqa: E731
    (expected,) = torch.func.vjp(f, x)[1]((None, torch.tensor(1.0)))
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("error", tv.GradOutputsWarning)
        (got,) = torch.func.vjp(f, x)[1]((None, torch.tensor(1.0)))
    torch.testing.assert_close(got, expected)


def test_sparse_coo_grad_outputs_accepted_csr_rejected_like_torch():
    x = torch.randn(3, 3, requires_grad=True)
    y = x * 2
    coo = torch.ones(3, 3).to_sparse()
    expected = torch.autograd.grad(y, x, coo, retain_graph=True)[0]
    assert torch.equal(tv.grad(y, x, coo, retain_graph=True)[0].to_dense(), expected.to_dense())
    assert tv.check_grad_outputs(y, coo)[0] is coo
    csr = torch.ones(3, 3).to_sparse_csr()
    with pytest.raises(RuntimeError, match="expected layout Strided but got SparseCsr"):
        torch.autograd.grad(y, x, csr, retain_graph=True)
    for fn in (lambda: tv.grad(y, x, csr, retain_graph=True),
               lambda: tv.check_grad_outputs(y, csr)):
        with pytest.raises(tv.GradOutputsError, match=r"has layout torch.sparse_csr, but "
                           r"outputs\[0\] has layout torch.strided") as info:
            fn()
        assert str(info.value) == "invalid gradient at index 0 - expected layout Strided but got SparseCsr"


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn")
@pytest.mark.parametrize("grad", [tv.grad, "checked"])
def test_an_mkldnn_vector_is_rejected_with_torch_s_own_sentence(grad):
    # torch names the layout "Mkldnn"; the checker's copy of the sentence said
    # "torch._mkldnn", so code matching torch's message broke under the checks
    x = torch.randn(3, 3, requires_grad=True)
    y = x * 2
    go = torch.ones(3, 3).to_mkldnn()
    with pytest.raises(RuntimeError) as torch_info:
        torch.autograd.grad(y, x, go, retain_graph=True)
    assert str(torch_info.value) == (
        "invalid gradient at index 0 - expected layout Strided but got Mkldnn")
    with pytest.raises(tv.GradOutputsError) as info:
        if grad == "checked":
            with tv.checked():
                torch.autograd.grad(y, x, go, retain_graph=True)
        else:
            grad(y, x, go, retain_graph=True)
    assert str(info.value) == str(torch_info.value)
    assert "has layout torch._mkldnn, but outputs[0] has layout torch.strided" in full_message(
        info.value)


# --------------------------------------------------------------------------------------
# Rejected calls: torch's sentence first, then torch_vjp's explanation
# --------------------------------------------------------------------------------------

def _x():
    return torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)


REJECTED = {
    # name: (call(grad), builtin class torch raises, explanation fragment)
    "shape": (lambda g, x: g(torch.outer(x, x), x, torch.ones(4)), RuntimeError,
              r"grad_outputs\[0\] has shape \(4,\), but outputs\[0\] has shape \(4, 4\)"),
    "shape-second-output": (lambda g, x: g([x * 2, torch.outer(x, x)], x,
                                           [torch.ones(4), torch.ones(3)]), RuntimeError,
                            r"grad_outputs\[1\] has shape \(3,\), but outputs\[1\]"),
    "implicit-non-scalar": (lambda g, x: g(torch.outer(x, x), x), RuntimeError,
                            r"no grad_outputs\[0\] was given"),
    "implicit-complex": (lambda g, x: g((x * 1j).sum(), x), RuntimeError,
                         r"is a scalar of dtype torch.complex64"),
    "complex-for-real": (lambda g, x: g(x * 2, x, torch.ones(4, dtype=torch.complex64)),
                         RuntimeError, r"never between complex and real"),
    "no-grad-fn": (lambda g, x: g([x.sum(), x.detach()], x, [None, torch.ones(4)]),
                   RuntimeError, r"outputs\[1\] \(shape \(4,\)\) does not require grad"),
    "too-few": (lambda g, x: g([x * 2, x * 3], x, [torch.ones(4)]), RuntimeError,
                r"got 2 outputs but 1 grad_outputs"),
    "entry-type": (lambda g, x: g(x * 2, x, [5]), TypeError,
                   r"grad_outputs\[0\] is an int, but each entry"),
    "not-iterable": (lambda g, x: g(x * 2, x, 5), TypeError, r"grad_outputs is an int"),
    "outputs-none": (lambda g, x: g(None, x), TypeError, r"outputs is None"),
    "batched-shape": (lambda g, x: g(x * 2, x, torch.ones(3, 5), is_grads_batched=True),
                      RuntimeError, r"is_grads_batched=True"),
    "batched-0d": (lambda g, x: g(x * 2, x, torch.tensor(1.0), is_grads_batched=True),
                   IndexError, r"grad_outputs\[0\] has shape \(\)"),
    "batched-empty": (lambda g, x: g(x * 2, x, torch.ones(0, 4), is_grads_batched=True),
                      IndexError, r"a batch of K = 0 vectors"),
    "batched-sizes-differ": (lambda g, x: g([x * 2, x * 3], x, [torch.ones(3, 4),
                                                               torch.ones(2, 4)],
                                            is_grads_batched=True),
                             ValueError, r"different batch sizes"),
}


@pytest.mark.parametrize("case", REJECTED, ids=list(REJECTED))
def test_rejected_calls_start_with_torchs_sentence(case):
    call, builtin, fragment = REJECTED[case]
    with pytest.raises(builtin) as torch_info:
        call(torch.autograd.grad, _x())
    sentence = str(torch_info.value)
    for how in ("drop-in", "checked"):
        with pytest.raises(tv.GradOutputsError, match=fragment) as info:
            if how == "drop-in":
                call(tv.grad, _x())
            else:
                with tv.checked():
                    call(torch.autograd.grad, _x())
        err = info.value
        assert isinstance(err, builtin) and isinstance(err, tv.TorchVJPError)
        if case == "shape-second-output":  # torch's own sentence is wrong there: see below
            assert str(err) == ("Mismatch in shape: grad_output[1] has a shape of "
                                "torch.Size([3]) and output[1] has a shape of "
                                "torch.Size([4, 4]).")
            assert "ambiguous" in sentence or "must match the size" in sentence
        elif case == "batched-shape":  # torch strips the batch dimension twice
            assert str(err).startswith("If `is_grads_batched=True`, we interpret the first")
            assert "grad_output[0] has a shape of torch.Size([5])" in str(err)
        else:
            assert str(err) == sentence
        # the explanation follows as a note
        assert full_message(err).startswith(str(err) + "\n")


def test_backward_rejections_start_with_torchs_sentence():
    x = torch.ones(4, requires_grad=True)
    with pytest.raises(RuntimeError) as torch_info:
        (x * 2).backward(torch.ones(3))
    with tv.checked():
        with pytest.raises(tv.GradOutputsError) as info:
            (x * 2).backward(torch.ones(3))
    assert str(info.value) == str(torch_info.value)
    assert info.value.explanation.startswith("y.backward(gradient): gradient has shape (3,)")


# --------------------------------------------------------------------------------------
# checked(): scope, nesting, other code's patches
# --------------------------------------------------------------------------------------


def _checking() -> bool:
    """Whether a wrong-shaped gradient raises torch_vjp's error here."""
    x = torch.ones(2, requires_grad=True)
    try:
        (x * 2).backward(torch.ones(3))
    except tv.GradOutputsError:
        return True
    except RuntimeError:
        return False
    raise AssertionError("no error at all")


def test_exit_keeps_a_patch_made_inside_the_block():
    original = torch.autograd.grad

    def my_grad(*args, **kwargs):
        return original(*args, **kwargs)

    try:
        with tv.checked():
            torch.autograd.grad = my_grad
        assert torch.autograd.grad is my_grad
    finally:
        torch.autograd.grad = original


def test_exit_keeps_a_patch_made_before_the_block():
    original = torch.autograd.grad

    def my_grad(*args, **kwargs):
        my_grad.calls += 1
        return original(*args, **kwargs)

    my_grad.calls = 0
    try:
        torch.autograd.grad = my_grad
        with tv.checked():
            x = torch.ones(2, requires_grad=True)
            torch.autograd.grad((x * x).sum(), x)
        assert my_grad.calls == 1  # the patch still runs under checks
        assert torch.autograd.grad is my_grad
    finally:
        torch.autograd.grad = original
    with tv.checked():
        pass
    assert torch.autograd.grad is original  # not re-installed


def test_stray_second_exit_does_not_end_another_block():
    outer, stray = tv.checked(), tv.checked()
    with outer:
        stray.__enter__()
        stray.__exit__(None, None, None)
        stray.__exit__(None, None, None)  # a stray second exit
        assert _checking()
    assert not _checking()


def test_scope_is_per_thread():
    results = {}
    inside = threading.Event()
    done = threading.Event()

    def other():
        inside.wait(10)
        results["other"] = _checking()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with tv.checked():
        inside.set()
        done.wait(10)
        results["here"] = _checking()
    thread.join(10)
    assert results == {"here": True, "other": False}


def test_decorator_on_generator_checks_its_body_only():
    @tv.checked()
    def gen():
        yield _checking()
        yield _checking()

    it = gen()
    assert next(it) is True
    assert not _checking()  # not while the generator is suspended
    assert next(it) is True
    assert list(it) == []


def test_decorator_on_async_function_and_async_generator():
    @tv.checked()
    async def coro():
        await asyncio.sleep(0)
        return _checking()

    @tv.checked()
    async def agen():
        yield _checking()

    async def collect():
        return [item async for item in agen()]

    assert asyncio.run(coro()) is True
    assert asyncio.run(collect()) == [True]
    assert not _checking()


def test_torch_function_overrides_see_the_public_functions():
    # torch hands __torch_function__ what its names hold when the call is made (its own
    # functions look themselves up by name), so an override that recognises
    # torch.autograd.grad, torch.autograd.backward or Tensor.backward recognises them in a
    # checked block too, where those names hold the checking wrappers.
    seen = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            names = {torch.autograd.grad: "grad", torch.autograd.backward: "backward",
                     torch.Tensor.backward: "Tensor.backward"}
            if func in names:
                seen.append(names[func])
            return super().__torch_function__(func, types, args, kwargs or {})

    def calls():
        x = torch.ones(3, requires_grad=True)
        y = (x * 2).as_subclass(Logged).sum()
        torch.autograd.grad(y, x, retain_graph=True)
        y.backward(retain_graph=True)
        torch.autograd.backward(y)

    calls()
    plain, seen[:] = list(seen), []
    with tv.checked():
        calls()
    assert plain == ["grad", "Tensor.backward", "backward"]
    assert seen == plain


def test_tensor_backward_calls_torch_autograd_backward_as_patched():
    # Tensor.backward looks torch.autograd.backward up when it is called: a patch of it
    # (a mock, a tracer's shim) sees Tensor.backward's calls, checked or not.
    from unittest import mock

    calls = []
    current = torch.autograd.backward

    def spy(*args, **kwargs):
        calls.append(1)
        return current(*args, **kwargs)

    x = torch.ones(3, requires_grad=True)
    with mock.patch.object(torch.autograd, "backward", spy):
        (x * 2).sum().backward()
    with tv.checked():
        with mock.patch.object(torch.autograd, "backward", spy):
            (x * 2).sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(x.grad, torch.full((3,), 4.0))


def test_engine_patch_point_is_honoured():
    calls = []
    original = torch.autograd._engine_run_backward

    def patched(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    torch.autograd._engine_run_backward = patched
    try:
        x = torch.ones(2, requires_grad=True)
        tv.grad((x * x).sum(), x)
        tv.backward((x * x).sum())
        with tv.checked():
            (x * x).sum().backward()
    finally:
        torch.autograd._engine_run_backward = original
    assert len(calls) == 3


_COMPILE_COUNTS = """
import torch, torch._dynamo.testing, torch_vjp as tv

def by_grad(x):
    return torch.autograd.grad((x.sin() * 2).sum(), x)

def by_backward(x):
    (x.sin() * 2).sum().backward()
    return x.grad

def by_func_vjp(x):
    out, pullback = torch.func.vjp(torch.sin, x)
    return pullback(torch.ones_like(out))[0]

def counts():
    out = []
    for fn in (by_grad, by_backward, by_func_vjp):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        torch.compile(fn, backend=counter)(torch.ones(3, requires_grad=True))
        out.append((counter.frame_count, counter.op_count))
    return out

plain = counts()
with tv.checked():
    checked = counts()
print(plain, checked)
assert checked == plain, (plain, checked)
"""


def test_torch_compile_traces_the_same_graphs_in_a_checked_block():
    # dynamo knows torch.autograd.grad, Tensor.backward and torch.func.vjp by identity; a
    # checked block must not change what it traces (graph breaks, operators: torch.func.vjp's
    # wrapper was traced and failed on its ContextVar). In a fresh process: what
    # earlier tests leave in dynamo's state changes the counts of both runs. A child of the
    # fork server the distributed tests' ranks share (torch and torch_vjp imported there
    # once, dynamo never run) where no TORCH_VJP_CHECKED was set when it started; else a
    # fresh interpreter with checking off.
    from _shared_functions import run_forked

    if "TORCH_VJP_CHECKED" not in os.environ:
        printed, error = run_forked(_COMPILE_COUNTS, timeout=300)
        assert not error, printed + error
        return
    env = {**os.environ, "TORCH_VJP_CHECKED": "0"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_COUNTS], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_replayed_backward_is_not_seen_by_dispatch_modes(op_log):
    # A custom backward whose return torch casts (float64 for a float32 input) is replayed
    # to learn torch's verdict; an op logger or FLOP counter around the backward must see
    # the user's pass only.
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return (g * 2).double()

    def ops():
        x = torch.ones(3, requires_grad=True)
        y = Twice.apply(x).sum()
        with op_log() as log:
            y.backward()
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
        return log.ops

    plain = ops()
    with tv.checked(), warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.FunctionCheckWarning)  # the cast is reported
        checked = ops()
    assert checked == plain


def test_torch_rejecting_another_argument_first_raises_torchs_error():
    # torch refuses materialize_grads=True with allow_unused=False before it looks at
    # grad_outputs; the mismatched grad_outputs must not replace torch's own error.
    x = torch.ones(3, requires_grad=True)

    def call():
        torch.autograd.grad(x * 2, x, torch.ones(4), allow_unused=False, materialize_grads=True)

    with pytest.raises(ValueError) as plain:
        call()
    with tv.checked(), pytest.raises(ValueError) as checked:
        call()
    assert type(checked.value) is type(plain.value)
    assert full_message(checked.value) == full_message(plain.value)
    assert str(plain.value).startswith("Expected allow_unused to be True")


def test_torchscript_compiles_autograd_calls_under_checks():
    with tv.checked():
        @torch.jit.script
        def grads(x: torch.Tensor):
            y = x * x
            return torch.autograd.grad([y.sum()], [x])

        x = torch.ones(3, requires_grad=True)
        (g,) = grads(x)
    torch.testing.assert_close(g, torch.full((3,), 2.0))


def test_torchscript_compiles_tv_grad():
    @torch.jit.script
    def grads(x: torch.Tensor):
        return tv.grad([(x * x).sum()], [x])

    (g,) = grads(torch.ones(3, requires_grad=True))
    torch.testing.assert_close(g, torch.full((3,), 2.0))


# (every spelling of the switch is read by env_flag, tested on its own in test_errors.py;
# here a fresh process for each outcome)
@pytest.mark.parametrize("value, on", [("YES", True), ("off", False), ("", False)])
def test_environment_variable_values(value, on):
    code = "import torch, torch_vjp\nfrom torch_vjp.autograd import is_checked\nprint(is_checked())\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_VJP_")}
    env["TORCH_VJP_CHECKED"] = value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(on)


def test_is_checked_outside_any_block():
    assert not autograd.is_checked()


def test_environment_variable_logs_no_api_usage_of_its_own():
    # TORCH_VJP_CHECKED=1 imports torch_vjp in every process that imports torch; importing it
    # must not do what the user's program did not: building an nn.Module (to learn its
    # attributes) logged torch's "python.nn_module" API usage in a program that has none.
    code = "import torch\nx = torch.ones(3, requires_grad=True)\n(x * 2).sum().backward()\n"

    def usage(checked):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_VJP_")}
        env["PYTORCH_API_USAGE_STDERR"] = "1"
        if checked:
            env["TORCH_VJP_CHECKED"] = "1"
        else:
            env["TORCH_VJP_AUTOLOAD"] = "0"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return {line for line in out.stderr.splitlines() if line.startswith("PYTORCH_API_USAGE")}

    plain = usage(checked=False)
    assert "PYTORCH_API_USAGE torch.python.import" in plain
    assert usage(checked=True) == plain


def test_decorated_generators_throw_with_one_argument():
    """An exception thrown into a decorated generator reaches the user's generator as
    ``throw(exc)``: the three-argument ``throw(type, value, traceback)`` is deprecated since
    Python 3.12 (a DeprecationWarning for every exception thrown in; the package supports
    3.10+)."""
    import asyncio

    thrown = []

    class FakeGenerator:
        def send(self, value):
            return 1

        def throw(self, *args):
            thrown.append(args)
            raise StopIteration(5)

    class FakeAsyncGenerator:
        async def asend(self, value):
            return 1

        async def athrow(self, *args):
            thrown.append(args)
            raise StopAsyncIteration

    it = tv.checked()._generator(lambda: FakeGenerator())()
    assert next(it) == 1
    error = ValueError("into the generator")
    with pytest.raises(StopIteration):
        it.throw(error)

    async def drive():
        agen = tv.checked()._async_generator(lambda: FakeAsyncGenerator())()
        assert await agen.asend(None) == 1
        with pytest.raises(StopAsyncIteration):
            await agen.athrow(error)

    asyncio.run(drive())
    assert thrown == [(error,), (error,)]
