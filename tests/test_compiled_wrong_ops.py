"""jacobian(compile=True) through an operator whose backward torch (2.13) batches wrongly
(torch.cdist under torch.vmap): the compiled program must not return what eager "rev"
reroutes away from, even where the first call (the one compared with the eager result) sits
at a point where the wrong products happen to agree. float64, against a per-row loop of
torch.func.vjp (each product alone is right)."""

import warnings

import pytest
import torch

import torch_vjp as tv
from torch_vjp._engine.compiled import builds, clear_cache

D = torch.float64


def _rows(f, x):
    out, pull = torch.func.vjp(f, x)
    eye = torch.eye(out.numel(), dtype=out.dtype)
    return torch.stack([pull(e.reshape(out.shape))[0] for e in eye]).reshape(*out.shape,
                                                                             *x.shape)


def _cdist_f():
    y = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(1))

    def f(x):
        # (at a point where x sums to 0, cdist's products are multiplied by 0: the wrong
        # batched rows agree with the right ones there, and only there)
        return torch.cdist(x.reshape(4, 3), y) * x.sum()

    return f


@pytest.fixture(autouse=True)
def _fresh():
    clear_cache()
    yield
    clear_cache()


def test_compiled_rev_through_cdist_stays_right_after_a_first_call_where_it_agreed():
    f = _cdist_f()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(12, dtype=D, generator=g)
    x0 = x0 - x0.mean()  # (f's products through cdist vanish here)
    x = torch.randn(12, dtype=D, generator=g)
    # (the case: torch.func's vmapped reverse rows are wrong at x, right at x0)
    assert not torch.allclose(torch.func.jacrev(f)(x), _rows(f, x))
    torch.testing.assert_close(torch.func.jacrev(f)(x0), _rows(f, x0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = tv.jacobian(f, x0, compile=True, strategy="rev")
    torch.testing.assert_close(first, _rows(f, x0))
    said = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    assert said == [
        "torch_vjp.jacobian: compile=True could not compile the computation for "
        "_cdist_f.<locals>.f, so it runs eagerly for this input signature.\n"
        "  Why: f's graph holds torch.cdist, whose backward torch batches wrongly under "
        "torch.vmap (the rows are off by a relative error near 1, each alone is right); "
        "the compiled program would compute its reverse products under torch.vmap, and "
        "the eager call computes them one at a time\n"
        "  The eager result is exact; only the speed-up is lost. Pass compile=False to "
        "skip the attempt. This warning is shown once."]
    for _ in range(2):  # (later calls: the eager rows, right at every point)
        torch.testing.assert_close(tv.jacobian(f, x, compile=True, strategy="rev"),
                                   _rows(f, x))
    torch.testing.assert_close(tv.jacobian(f, x, compile=True, strategy="rev"),
                               tv.jacobian(f, x, strategy="rev"))


def test_compiled_jacobian_without_the_operator_still_compiles():
    W = torch.randn(3, 4, dtype=D)
    f = lambda x: W @ x.sin()  # noqa: E731
    x = torch.randn(4, dtype=D)
    before = builds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tv.jacobian(f, x, compile=True, strategy="rev")
    assert not [w for w in caught if issubclass(w.category, tv.JacobianWarning)]
    assert builds() == before + 1
    torch.testing.assert_close(tv.jacobian(f, x, compile=True, strategy="rev"),
                               W * x.cos())


def test_compiled_batch_jacobian_rev_through_cdist_after_a_first_call_where_it_agreed():
    y = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(2))

    def f(x):  # (B, 6) -> (B, 2, 5): per example, cdist times the example's sum
        return torch.cdist(x.reshape(-1, 2, 3), y.expand(x.shape[0], 5, 3)) \
            * x.sum(-1)[:, None, None]

    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(3, 6, dtype=D, generator=g)
    x0 = x0 - x0.mean(-1, keepdim=True)  # (the products through cdist vanish here)
    x = torch.randn(3, 6, dtype=D, generator=g)

    def per_row(x):  # (each example alone, one product at a time: no vmap)
        return torch.stack([_rows(lambda r: f(r[None])[0], r) for r in x])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = tv.batch_jacobian(f, x0, compile=True, strategy="rev")
    torch.testing.assert_close(first, per_row(x0))
    said = [str(w.message) for w in caught if "compile=True" in str(w.message)]
    assert len(said) == 1 and "f's graph holds torch.cdist, whose backward torch batches " \
        "wrongly under torch.vmap" in said[0] and "runs eagerly" in said[0]
    for _ in range(2):  # (later calls: the eager rows, right at every point)
        torch.testing.assert_close(tv.batch_jacobian(f, x, compile=True, strategy="rev"),
                                   per_row(x), rtol=1e-10, atol=1e-10)
