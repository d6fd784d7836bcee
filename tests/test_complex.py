"""Complex numbers in VJPs and JVPs: torch's conventions, on a case table of operators with
complex inputs or outputs, in complex128/float64, against torch.func and finite differences.

The convention (torch's, docs page "Complex numbers"): a JVP is the directional derivative,
``jvp(t) = lim (f(x + eps t) - f(x)) / eps``; a VJP is its adjoint for the real inner product
``<a, b> = Re(sum(conj(a) * b))``, which makes ``vjp(c)`` the gradient of the real function
``Re <c, f(x)>`` as torch writes gradients (the conjugate Wirtinger derivative, times 2):
``<c, jvp(t)> == <vjp(c), t>``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_vjp as tv

D, C = torch.float64, torch.complex128


def _window():
    return torch.hann_window(8, dtype=D)


def _stft(x):
    return torch.stft(x, n_fft=8, hop_length=2, window=_window(), return_complex=True)


def _istft(z):
    return torch.istft(z, n_fft=8, hop_length=2, window=_window(), length=24)


def _r(*shape):
    return torch.randn(*shape, dtype=D)


def _c(*shape):
    return torch.randn(*shape, dtype=C)


# name: (f, primals) -- f of several primals is differentiated with respect to all of them
CASES = {
    "fft.fft": lambda: (torch.fft.fft, (_c(6),)),
    "fft.ifft": lambda: (torch.fft.ifft, (_c(6),)),
    "fft.rfft": lambda: (torch.fft.rfft, (_r(8),)),
    "fft.irfft": lambda: (torch.fft.irfft, (_c(5),)),
    "fft.hfft": lambda: (torch.fft.hfft, (_c(5),)),
    "fft.ihfft": lambda: (torch.fft.ihfft, (_r(8),)),
    "fft.fft2": lambda: (torch.fft.fft2, (_c(3, 4),)),
    "fft.rfftn": lambda: (torch.fft.rfftn, (_r(3, 4),)),
    "fft.fftshift(fft)": lambda: (lambda z: torch.fft.fftshift(torch.fft.fft(z)), (_c(5),)),
    "stft": lambda: (_stft, (_r(24),)),
    "istft": lambda: (_istft, (_stft(_r(24)),)),
    "view_as_complex": lambda: (lambda x: torch.view_as_complex(x) ** 2, (_r(4, 2),)),
    "view_as_real": lambda: (lambda z: torch.view_as_real(z * z), (_c(4),)),
    "polar": lambda: (torch.polar, (_r(4).abs() + 0.5, _r(4))),
    "complex(re, im)": lambda: (lambda a, b: torch.complex(a, b).exp(), (_r(3), _r(3))),
    "abs": lambda: (torch.abs, (_c(4),)),
    "abs-sum": lambda: (lambda z: z.abs().sum(), (_c(4),)),
    "angle": lambda: (torch.angle, (_c(4),)),
    "real-imag": lambda: (lambda z: z.real * z.imag, (_c(4),)),
    "conj-mul": lambda: (lambda z: z * z.conj() * z, (_c(4),)),
    "exp": lambda: (torch.exp, (_c(4),)),
    "matmul": lambda: (lambda a, b: a @ b, (_c(3, 4), _c(4, 2))),
    "real-times-complex": lambda: (lambda x, z: x * z.sin(), (_r(4), _c(4))),
    "pytree-out": lambda: (lambda z: {"re": z.abs() ** 2, "z": z.exp()}, (_c(3),)),
    "linalg.norm": lambda: (lambda z: torch.linalg.norm(z), (_c(3, 3),)),
}
IDS = list(CASES)


def _like(t):
    return torch.randn(t.shape, dtype=t.dtype)


def _inner(a, b):
    """Re(sum(conj(a) * b)) summed over matching pytrees."""
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    return sum(float((x.conj() * y).real.sum()) for x, y in zip(la, lb))


def _close(got, want):
    got_l, got_s = tree_flatten(got)
    want_l, want_s = tree_flatten(want)
    assert got_s == want_s
    for g, w in zip(got_l, want_l):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("case", IDS, ids=IDS)
def test_vjp_matches_torch_func(case):
    f, primals = CASES[case]()
    out, vjp_fn = tv.vjp(f, *primals)
    ref_out, ref_fn = torch.func.vjp(f, *primals)
    _close(out, ref_out)
    c = tree_map(_like, out)
    _close(vjp_fn(c), ref_fn(c))


@pytest.mark.parametrize("case", IDS, ids=IDS)
def test_jvp_matches_torch_func_and_finite_differences(case):
    f, primals = CASES[case]()
    t = tuple(_like(p) for p in primals)
    out, jt = tv.jvp(f, primals, t)
    ref_out, ref_jt = torch.func.jvp(f, primals, t)
    _close(out, ref_out)
    _close(jt, ref_jt)
    eps = 1e-6
    plus = f(*(p + eps * d for p, d in zip(primals, t)))
    minus = f(*(p - eps * d for p, d in zip(primals, t)))
    fd = tree_map(lambda a, b: (a - b) / (2 * eps), plus, minus)
    for g, w in zip(tree_flatten(jt)[0], tree_flatten(fd)[0]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", IDS, ids=IDS)
def test_vjp_is_the_adjoint_of_jvp(case):
    """<c, J t> == <J* c, t> for the real inner product Re(sum(conj(a) b))."""
    f, primals = CASES[case]()
    out, vjp_fn = tv.vjp(f, *primals)
    t = tuple(_like(p) for p in primals)
    _, jt = tv.jvp(f, primals, t)
    c = tree_map(_like, out)
    lhs, rhs = _inner(c, jt), _inner(vjp_fn(c), t)
    assert abs(lhs - rhs) <= 1e-10 * (1 + abs(lhs))


@pytest.mark.parametrize("case", IDS, ids=IDS)
def test_batched_products_stack_the_single_ones(case):
    f, primals = CASES[case]()
    out, vjp_fn = tv.vjp(f, *primals)
    cs = [tree_map(_like, out) for _ in range(3)]
    stacked_c = tree_map(lambda *v: torch.stack(v), *cs)
    for chunk_size in (None, 2):
        got = vjp_fn(stacked_c, batched=True, chunk_size=chunk_size)
        _close(got, tree_map(lambda *v: torch.stack(v), *[vjp_fn(c) for c in cs]))
    ts = [tuple(_like(p) for p in primals) for _ in range(3)]
    stacked_t = tuple(torch.stack(v) for v in zip(*ts))
    _, jts = tv.jvp(f, primals, stacked_t, batched=True)
    _close(jts, tree_map(lambda *v: torch.stack(v), *[tv.jvp(f, primals, t)[1] for t in ts]))


def test_issue_examples():
    x = torch.randn(8, dtype=D)
    out, vjp_fn = tv.vjp(torch.fft.rfft, x)
    assert out.dtype == C
    (g,) = vjp_fn(torch.ones(5, dtype=C))
    torch.testing.assert_close(g, torch.func.vjp(torch.fft.rfft, x)[1](torch.ones(5, dtype=C))[0])
    z = torch.randn(4, dtype=C)
    out, vjp_fn = tv.vjp(lambda z: z.abs().sum(), z)
    (g,) = vjp_fn(torch.ones((), dtype=D))
    torch.testing.assert_close(g, z / z.abs())  # d|z|: the unit vector, as torch writes it


def test_complex_cotangent_for_a_real_output_is_refused_with_the_fix():
    z = torch.randn(4, dtype=C)
    _, vjp_fn = tv.vjp(torch.abs, z)
    with pytest.raises(tv.GradOutputsError, match=r"(?s)complex.*real"):
        vjp_fn(torch.ones(4, dtype=C))
    _, vjp_fn = tv.vjp(torch.exp, z)
    with pytest.raises(tv.GradOutputsError, match=r"(?s)pass .*\.to\(torch\.complex128\)"):
        vjp_fn(torch.ones(4, dtype=D))


def test_real_tangent_for_a_complex_primal_is_the_direction_with_zero_imaginary_part():
    # torch.func.jvp takes it; a complex tangent for a real primal stays refused
    z = torch.randn(3, dtype=C)
    _, tan = tv.jvp(torch.exp, (z,), (torch.ones(3, dtype=D),))
    torch.testing.assert_close(tan, torch.func.jvp(torch.exp, (z,), (torch.ones(3, dtype=C),))[1])
    with pytest.raises(tv.GradOutputsError, match=r"complex"):
        tv.jvp(torch.exp, (torch.randn(3, dtype=D),), (torch.ones(3, dtype=C),))


def test_integer_output_names_both_kinds_in_vjp():
    with pytest.raises(tv.JacobianCallError, match=r"only floating-point or complex outputs can "
                       r"be differentiated \(as in torch\.func\.vjp\)"):
        tv.vjp(lambda x: x.long(), torch.randn(3, dtype=D))


@pytest.mark.parametrize("strategy", ["auto", "rev", "fwd", "rev-loop", "fwd-loop"])
def test_jacobians_refuse_complex_as_torch_func_does(strategy):
    """torch.func.jacrev/jacfwd/hessian refuse complex inputs and outputs; so do the Jacobian
    functions, naming the way out (view_as_real, or vjp/jvp)."""
    x, z = torch.randn(8, dtype=D), torch.randn(4, dtype=C)
    with pytest.raises(RuntimeError, match="Expected all outputs to be real"):
        torch.func.jacrev(torch.fft.rfft)(x)
    with pytest.raises(tv.JacobianCallError, match=r"the output of f has dtype torch\.complex128;"
                       r" only real floating-point outputs have a Jacobian here .*Fix: return "
                       r"torch\.view_as_real\(\.\.\.\) of it .* or use torch_vjp\.vjp / "
                       r"torch_vjp\.jvp, which take complex outputs\."):
        tv.jacobian(torch.fft.rfft, x, strategy=strategy)
    with pytest.raises(tv.JacobianCallError, match=r"primals\[0\] has dtype torch\.complex128; "
                       r"Jacobians here .* or use torch_vjp\.vjp / torch_vjp\.jvp, which take "
                       r"complex tensors\."):
        tv.jacobian(torch.abs, z, strategy=strategy)
    with pytest.raises(tv.JacobianCallError, match=r"primals\[0\] has dtype torch\.complex128"):
        tv.hessian(lambda z: z.abs().sum(), z, strategy=strategy)


def test_jacobian_through_view_as_real_matches_the_jvps():
    """The way out the message names: the real Jacobian of the real view."""
    z = torch.randn(3, dtype=C)

    def f(zr):
        return torch.view_as_real(torch.view_as_complex(zr).exp())

    zr = torch.view_as_real(z).clone()
    J = tv.jacobian(f, zr)
    torch.testing.assert_close(J, torch.func.jacrev(f)(zr))
    t = torch.randn(3, dtype=C)
    _, jt = tv.jvp(torch.exp, (z,), (t,))
    torch.testing.assert_close(
        torch.view_as_real(jt), torch.einsum("abij,ij->ab", J, torch.view_as_real(t))
    )
