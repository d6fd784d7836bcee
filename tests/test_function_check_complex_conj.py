"""check_function on a complex backward that conjugates where PyTorch's convention does not,
or does not where it does (``grad * 2 * z`` for ``z * z``; ``g @ b.mT`` for ``a @ b``): the
commonest mistake of complex custom Functions. The message said only "re-derive backward";
it now says that the gradient matches once conjugated, what the convention is, and the fix.
"""

from __future__ import annotations

import pytest
import torch

from torch_vjp import FunctionCheckError, check_function

C128 = torch.complex128


def _function(name: str, forward, backward):
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(backward)})


def _save(ctx, *tensors):
    ctx.save_for_backward(*tensors)


def _square_fwd(ctx, z):
    _save(ctx, z)
    return z * z


def _mm_fwd(ctx, a, b):
    _save(ctx, a, b)
    return a @ b


def _abs_fwd(ctx, z):
    _save(ctx, z)
    return z.abs()


WRONG = [
    # (id, forward, backward without torch's conjugation, inputs, the input blamed)
    ("square", _square_fwd, lambda ctx, g: g * 2 * ctx.saved_tensors[0],
     lambda: (torch.randn(5, dtype=C128),), 0),
    ("matmul_a", _mm_fwd,
     lambda ctx, g: (g @ ctx.saved_tensors[1].mT, ctx.saved_tensors[0].mH @ g),
     lambda: (torch.randn(3, 4, dtype=C128), torch.randn(4, 2, dtype=C128)), 0),
    ("matmul_b", _mm_fwd,
     lambda ctx, g: (g @ ctx.saved_tensors[1].mH, ctx.saved_tensors[0].mT @ g),
     lambda: (torch.randn(3, 4, dtype=C128), torch.randn(4, 2, dtype=C128)), 1),
    ("abs", _abs_fwd, lambda ctx, g: g * ctx.saved_tensors[0].conj() / ctx.saved_tensors[0].abs(),
     lambda: (torch.randn(5, dtype=C128),), 0),
]


@pytest.mark.parametrize("case", WRONG, ids=[c[0] for c in WRONG])
def test_a_missing_or_extra_conjugation_is_named(case):
    name, fwd, bwd, inputs, i = case
    fn = _function("Cx", fwd, bwd)
    with pytest.raises(FunctionCheckError, match=rf"the gradient that Cx\.backward returns for "
                       rf"input {i} does not match finite differences") as info:
        check_function(fn, *inputs())
    text = str(info.value)
    assert "its complex conjugate matches them: Cx.backward conjugates where" in text, text
    assert "grad_output * f'(z).conj()" in text, text
    assert "grad_output @ b.mH, not b.mT" in text, text
    assert f"Fix: conjugate the derivative factors in Cx.backward for input {i}" in text, text
    assert "re-derive" not in text, text


def test_the_conjugated_backwards_pass():
    # the fixes the message gives, applied: each passes against finite differences
    right = {
        "square": lambda ctx, g: g * 2 * ctx.saved_tensors[0].conj(),
        "matmul": lambda ctx, g: (g @ ctx.saved_tensors[1].mH, ctx.saved_tensors[0].mH @ g),
        "abs": lambda ctx, g: g * ctx.saved_tensors[0] / ctx.saved_tensors[0].abs(),
    }
    check_function(_function("Sq", _square_fwd, right["square"]), torch.randn(5, dtype=C128))
    check_function(_function("Mm", _mm_fwd, right["matmul"]), torch.randn(3, 4, dtype=C128),
                   torch.randn(4, 2, dtype=C128))
    check_function(_function("Ab", _abs_fwd, right["abs"]), torch.randn(5, dtype=C128))


def test_a_complex_backward_wrong_otherwise_keeps_its_own_message():
    # twice the right gradient: a constant factor, not a conjugation
    fn = _function("Twice", _square_fwd, lambda ctx, g: g * 4 * ctx.saved_tensors[0].conj())
    with pytest.raises(FunctionCheckError) as info:
        check_function(fn, torch.randn(5, dtype=C128))
    text = str(info.value)
    assert "a constant factor off" in text, text
    assert "conjugate" not in text, text


def test_a_real_backward_is_not_told_of_conjugation():
    fn = _function("Real", _square_fwd, lambda ctx, g: g * 3 * ctx.saved_tensors[0])
    with pytest.raises(FunctionCheckError) as info:
        check_function(fn, torch.randn(5, dtype=torch.float64))
    assert "conjugate" not in str(info.value), str(info.value)
