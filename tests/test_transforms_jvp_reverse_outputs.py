"""torch_vjp.jvp by reverse over reverse (through torch.linalg.det, whose forward-mode
formula torch (2.13) has wrong at singular matrices) where f also returns an output that is
not a function of the primals in reverse mode: a constant (NOTE [a constant output] in
torch_vjp/_engine/revjvp.py), an integer tensor, the primal itself. Each output's tangent
as torch.func.jvp gives it, the det output's against torch.func.jacrev(f)(x) @ t and
central differences."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64
W = torch.arange(1.0, 4.0, dtype=D)
SINGULAR = torch.tensor([[1., 2, 3], [0, 0, 0], [4, 5, 7]], dtype=D)

pytestmark = pytest.mark.usefixtures("fresh_route_checks")


def _det(A):
    return torch.linalg.det(A) * W + A.sum(0)


def _tangents(k=None, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(((k,) if k else ()) + SINGULAR.shape, dtype=D, generator=g)


def _det_jt(t):
    J = torch.func.jacrev(_det)(SINGULAR).reshape(3, -1)
    return (t.reshape(-1, 9) @ J.T).reshape(t.shape[:-2] + (3,))


def _jvp(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        return tv.jvp(*args, **kwargs)


OTHERS = {
    "constant": lambda A: torch.ones(4, dtype=D),
    "constant-drawn": lambda A: torch.randn(4, dtype=D),
    "integer": lambda A: torch.arange(4),
    "integer-of-x": lambda A: (A > 1).sum(0),
    "the-primal": lambda A: A,
}


def test_the_reference_is_right_and_forward_mode_is_wrong_here():
    t = _tangents()
    eps = 1e-6
    central = (_det(SINGULAR + eps * t) - _det(SINGULAR - eps * t)) / (2 * eps)
    torch.testing.assert_close(_det_jt(t), central)
    assert not torch.allclose(torch.func.jvp(_det, (SINGULAR,), (t,))[1], central)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("other", list(OTHERS))
def test_an_output_reverse_mode_does_not_reach_has_torch_func_jvps_tangent(other, batched):
    # (a constant output was refused as if computed under torch.no_grad(); with an integer
    # output the reading of f's graph failed, and forward mode's wrong J t came back)
    g = OTHERS[other]

    def f(A):
        return {"det": _det(A), "other": g(A)}

    t = _tangents(k=3 if batched else None)
    for _ in range(2):  # (the first call, which reads f's graph, and a later one)
        torch.manual_seed(0)
        out, jt = _jvp(f, (SINGULAR,), (t,), batched=batched)
        torch.manual_seed(0)
        expected = f(SINGULAR)
        torch.testing.assert_close(out["other"], expected["other"])
        torch.testing.assert_close(jt["det"], _det_jt(t))
        if other == "the-primal":
            torch.testing.assert_close(jt["other"], t)
            assert jt["other"].data_ptr() != t.data_ptr()
        else:
            zeros = torch.zeros(((3,) if batched else ()) + expected["other"].shape,
                                dtype=expected["other"].dtype)
            assert jt["other"].dtype == zeros.dtype
            torch.testing.assert_close(jt["other"], zeros)
            if not batched:
                torch.testing.assert_close(
                    jt["other"], torch.func.jvp(f, (SINGULAR,), (t,))[1]["other"])


def test_with_aux_and_a_constant_output():
    def f(A):
        return (_det(A), torch.ones(2, dtype=D)), {"n": A.norm(), "i": torch.arange(2)}

    t = _tangents()
    out, jt, aux = _jvp(f, (SINGULAR,), (t,), has_aux=True)
    torch.testing.assert_close(jt[0], _det_jt(t))
    torch.testing.assert_close(jt[1], torch.zeros(2, dtype=D))
    torch.testing.assert_close(aux["n"], SINGULAR.norm())
    torch.testing.assert_close(aux["i"], torch.arange(2))


def test_the_draws_of_f_are_not_moved_by_the_check_of_a_constant():
    # (the constant's check calls f once more, on forked generators)
    def f(A):
        return _det(A), torch.randn(3, dtype=D)

    t = _tangents()
    for _ in range(2):
        torch.manual_seed(3)
        out, _ = _jvp(f, (SINGULAR,), (t,))
        after = torch.randn(2, dtype=D)
        torch.manual_seed(3)
        _, drawn = f(SINGULAR)
        torch.testing.assert_close(out[1], drawn)
        torch.testing.assert_close(after, torch.randn(2, dtype=D))


def test_an_output_computed_under_no_grad_from_the_primal_is_still_refused():
    def f(A):
        with torch.no_grad():
            side = A.sin()
        return _det(A), side

    with pytest.raises(tv.JacobianCallError) as info:
        _jvp(f, (SINGULAR,), (_tangents(),))
    msg = str(info.value)
    assert ("so J t is computed by reverse over reverse, but f's (test_an_output_computed_"
            "under_no_grad_from_the_primal_is_still_refused.<locals>.f) output 1 (flat) "
            "(shape (3, 3)) does not require grad") in msg
    assert "Fix: return that tensor as aux (has_aux=True)" in msg
