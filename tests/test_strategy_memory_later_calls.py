"""Strategy choice, memory limits and the comparison tool: cases where a first call's
options or side effects changed what a later call computed or reported."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_vjp as tv

D = torch.float64


def _cdist_case():
    y = torch.randn(3, 2, dtype=D)
    x = torch.randn(4, 2, dtype=D)
    ref = torch.autograd.functional.jacobian(lambda a: torch.cdist(a, y), x)
    return y, x, ref


@pytest.mark.parametrize("first", [
    {"chunk_size": 1},
    {"max_memory": 1500},  # room for the result and one product: chunks of one
], ids=["chunk_size=1", "max_memory-one-product"])
@pytest.mark.parametrize("later", [{}, {"chunk_size": 3}], ids=["unchunked", "chunk_size=3"])
def test_auto_after_a_chunk_of_one_still_checks_vmap(first, later):
    # torch.cdist's backward has a wrong batching rule: reverse mode under vmap is wrong,
    # which "auto" finds by its check. A first call in chunks of one runs no vmap, so its
    # check said nothing about vmap, and must not stand for the vectorised calls after it.
    y, x, ref = _cdist_case()

    def f(a):
        return torch.cdist(a, y)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(tv.jacobian(f, x, **first), ref)
        torch.testing.assert_close(tv.jacobian(f, x, **later), ref)


def test_batch_jacobian_after_a_chunk_of_one_still_checks_vmap():
    y, _, _ = _cdist_case()
    xb = torch.randn(3, 4, 2, dtype=D)
    ref = torch.stack([torch.autograd.functional.jacobian(lambda r: torch.cdist(r, y), row)
                       for row in xb])

    def g(b):
        return torch.cdist(b, y.expand(3, 3, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(tv.batch_jacobian(g, xb, chunk_size=1), ref)
        torch.testing.assert_close(tv.batch_jacobian(g, xb), ref)


def test_compare_does_not_call_a_function_that_writes_into_its_input_random():
    # f scales its argument in place: a deterministic function. The report's second plain
    # call saw the argument the first had scaled, and called f random for the difference.
    def scale_in_place(a):
        a.mul_(2)
        return a.sin()

    x = torch.randn(4, dtype=D)
    x0 = x.clone()
    report = tv.compare_strategies(scale_in_place, x, strategies=("rev", "fwd"),
                                   min_run_time=0.001, memory=False)
    assert "random" not in report.reference, report.reference
    assert all(row.ok for row in report.rows), str(report)
    torch.testing.assert_close(x, x0, rtol=0, atol=0)
    want = torch.diag(2 * torch.cos(2 * x0))
    torch.testing.assert_close(tv.jacobian(scale_in_place, x), want)


@pytest.mark.parametrize("strategy", ["auto", "rev", "rev-loop"])
def test_max_memory_of_an_empty_output_needs_no_working_memory(strategy):
    # No output element: reverse mode computes no product, and the result is empty, so any
    # budget fits. It was refused for one product's working memory (32 kB here).
    x = torch.randn(1000, dtype=D)
    J = tv.jacobian(lambda a: a[:0] * 2, x, strategy=strategy, max_memory="1kB")
    assert J.shape == (0, 1000) and J.dtype == D


@pytest.mark.parametrize("strategy", ["auto", "fwd", "fwd-loop"])
def test_max_memory_of_an_empty_input_needs_no_working_memory(strategy):
    # No input element: forward mode computes no product; "auto" takes it rather than one
    # reverse product per output element, each budgeted working memory.
    y = torch.randn(1000, dtype=D)
    J = tv.jacobian(lambda a: y * a.sum(), torch.zeros(0, dtype=D), strategy=strategy,
                    max_memory="1kB")
    assert J.shape == (1000, 0) and J.dtype == D


def test_a_result_that_does_not_fit_is_still_refused():
    # (the budget still bounds a result that is not empty)
    x = torch.randn(1000, dtype=D)
    with pytest.raises(tv.JacobianMemoryError, match=r"the result needs 8 kB"):
        tv.jacobian(lambda a: a.sum()[None], x, strategy="rev", max_memory="1kB")


def test_compare_a_random_function_whose_output_size_changes():
    # f keeps a random subset of its input: two plain calls return different shapes. The
    # report's check for a random f compared them with torch.allclose, which raised torch's
    # broadcasting error out of compare_strategies.
    def random_subset(a):
        return a[torch.rand(a.shape, dtype=a.dtype) > 0.5].sin()

    torch.manual_seed(3)
    x = torch.randn(8, dtype=D)
    state = torch.get_rng_state()
    report = tv.compare_strategies(random_subset, x, strategies=("rev", "rev-loop"),
                                   min_run_time=0.001, memory=False)
    assert "f is random" in report.reference
    assert all(row.ok for row in report.rows), str(report)
    torch.testing.assert_close(torch.get_rng_state(), state, rtol=0, atol=0)
    # (each row's Jacobian was judged at the reference's draw: the one a call from here makes)
    torch.set_rng_state(state)
    keep = torch.rand(8, dtype=D) > 0.5
    want = torch.diag(x.cos())[keep]
    torch.set_rng_state(state)
    torch.testing.assert_close(tv.jacobian(random_subset, x, strategy="rev"), want)


@pytest.mark.parametrize("value, unitless", [(0.5, True), ("0.5", True), (1e-3, True),
                                             ("0.5B", False)], ids=repr)
def test_max_memory_under_a_byte_says_numbers_count_bytes(value, unitless):
    # max_memory=0.5 (meant as gigabytes) became a budget of 0 bytes, refused as a
    # Jacobian too large for 'max_memory=0 B'; the string '0.5' as 'zero bytes'.
    with pytest.raises(tv.JacobianOptionError) as info:
        tv.jacobian(torch.sin, torch.randn(3, dtype=D), max_memory=value)
    msg = str(info.value)
    assert msg.startswith(f"torch_vjp.jacobian: max_memory={value!r} is less than one byte, "
                          f"so no Jacobian fits it.")
    number = repr(value) if isinstance(value, float) else value.rstrip("B")
    hint = (f"A number, or a string without a unit, counts bytes: for {number} gigabytes, "
            f"write max_memory='{number}GB'.")
    assert (hint in msg) == unitless
    assert "Pass a number of bytes" in msg
    assert isinstance(info.value, ValueError)


def test_auto_checks_each_argnums_of_a_function_on_its_own():
    # a and b have one shape, so the two calls have one input signature. The Jacobian in b
    # runs no cdist backward, agrees with its check and was remembered as checked; the
    # Jacobian in a, whose cdist backward vmap batches wrongly, then went unchecked.
    y = torch.randn(3, 2, dtype=D)
    a = torch.randn(4, 2, dtype=D)
    b = torch.randn(4, 2, dtype=D)

    def f(p, q):
        return torch.cdist(p, y) * q.sum()

    want_a, want_b = torch.autograd.functional.jacobian(f, (a, b))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(tv.jacobian(f, a, b, argnums=1), want_b)
        torch.testing.assert_close(tv.jacobian(f, a, b, argnums=0), want_a)
        got_a, got_b = tv.jacobian(f, a, b, argnums=(0, 1))
    torch.testing.assert_close(got_a, want_a)
    torch.testing.assert_close(got_b, want_b)
