"""Sparse Jacobians with a user's pattern where an operator's batching rule is wrong
(torch.cdist's backward, torch 2.13): the probe's disagreement is the vectorised products',
not the pattern's, so the pattern is not refused and the products are computed one colour
at a time (NOTE [a cached plan, probed] in torch_vjp._sparse.probe)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

_CDIST = [
    # (p, compute_mode, rows of x, rows of y, batch)
    (1.0, "use_mm_for_euclid_dist_if_necessary", 3, 5, ()),
    (2.0, "donot_use_mm_for_euclid_dist", 4, 3, ()),
    (2.0, "use_mm_for_euclid_dist_if_necessary", 30, 27, ()),
    (float("inf"), "use_mm_for_euclid_dist_if_necessary", 3, 4, (2,)),
    (0.5, "use_mm_for_euclid_dist", 5, 2, ()),
    (3.0, "donot_use_mm_for_euclid_dist", 3, 3, (2,)),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["auto", "rev"])
@pytest.mark.parametrize("p, compute_mode, rows, other, batch", _CDIST,
                         ids=[f"p={c[0]}-{c[1]}-{c[2]}x{c[3]}-batch{c[4]}" for c in _CDIST])
def test_a_cdist_with_its_own_pattern_is_not_refused_and_is_right(
        p, compute_mode, rows, other, batch, mode, dtype):
    # the probe of a user's pattern compared the products computed together under vmap
    # (wrong: cdist's backward batches wrongly) with their own probe row, and raised
    # "pattern leaves out non-zeros of the Jacobian" for the exact pattern
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(*batch, other, 3, generator=gen, dtype=torch.float64).to(dtype)

    def f(x):
        return torch.cdist(x, y, p=p, compute_mode=compute_mode)

    x = torch.randn(*batch, rows, 3, generator=gen, dtype=torch.float64).to(dtype)
    pattern = tv.jacobian_sparsity(f, x)
    want = torch.autograd.functional.jacobian(f, x).reshape(-1, x.numel())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else {}
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = tv.sparse_jacobian(f, x, pattern=pattern, mode=mode, layout=torch.strided)
        torch.testing.assert_close(got, want, **tol)
    said = [str(w.message) for w in caught if "batching rule" in str(w.message)]
    assert not said or "one colour at a time" in said[0]


def test_the_warning_says_what_was_wrong_and_the_fix():
    y = torch.randn(4, 3, dtype=torch.float64)

    def f(x):
        return torch.cdist(x, y, p=1.0)

    x = torch.randn(3, 3, dtype=torch.float64)
    pattern = tv.jacobian_sparsity(f, x)
    # (known before any product: read off f's graph, NOTE [wrong batching rules])
    with pytest.warns(tv.JacobianWarning,
                      match=r"calls torch.cdist \(aten._cdist_forward\), whose backward torch "
                            r"computes wrongly under torch.vmap \(a wrong batching rule\)"
                            r"(.|\n)*Pass chunk_size=1"):
        tv.sparse_jacobian(f, x, pattern=pattern, mode="rev")


def test_the_warning_of_an_op_not_known_says_what_was_wrong_and_the_fix(monkeypatch):
    from torch_vjp._engine import wrongops

    monkeypatch.setattr(wrongops, "_BATCHED_WRONGLY", {})  # (cdist stands for an unknown op)
    y = torch.randn(4, 3, dtype=torch.float64)

    def f(x):
        return torch.cdist(x, y, p=1.0)

    x = torch.randn(3, 3, dtype=torch.float64)
    pattern = tv.jacobian_sparsity(f, x)
    with pytest.warns(tv.JacobianWarning,
                      match=r"computed together under torch.vmap disagree with one computed "
                            r"without it: an operator in f has a wrong batching rule "
                            r"\(torch.cdist's backward is one\)(.|\n)*Pass chunk_size=1"):
        got = tv.sparse_jacobian(f, x, pattern=pattern, mode="rev", layout=torch.strided)
    torch.testing.assert_close(got, torch.autograd.functional.jacobian(f, x).reshape(12, 9))


def test_a_pattern_that_leaves_out_entries_is_still_refused_where_vmap_is_right():
    # (the batching check does not excuse a pattern that is wrong)
    def f(x):
        return torch.cumsum(x, 0)

    x = torch.randn(6, dtype=torch.float64)
    with pytest.raises(tv.JacobianOptionError, match="pattern leaves out non-zeros"):
        tv.sparse_jacobian(f, x, pattern=torch.eye(6, dtype=torch.bool))
