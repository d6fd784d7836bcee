"""Sparse Jacobians (issue #15): detected patterns hold every non-zero on random points,
values equal torch.func.jacfwd's in float64 in every mode and layout, colourings are valid,
plans are cached, user patterns skip detection, and errors explain themselves."""

from __future__ import annotations

import functools
import re
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_vjp as tv
from torch_vjp._engine.problem import Problem
from torch_vjp._errors import (
    JacobianCallError,
    JacobianCallTypeError,
    JacobianMemoryError,
    JacobianOptionError,
    JacobianWarning,
    StrategyError,
    full_message,
)
from torch_vjp._sparse import compute
from torch_vjp._sparse.coloring import color_columns, color_rows, greedy, is_valid
from torch_vjp._sparse.pattern import Pattern
from torch_vjp.sparse import clear_cache, jacobian_sparsity, sparse_jacobian

D = torch.float64


def _w(*shape):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(sum(shape)))


def _banded(n, k):
    """An n x n weight with non-zeros on the diagonals -k..k only."""
    w = _w(n, n)
    i = torch.arange(n)
    return torch.where((i[:, None] - i[None, :]).abs() <= k, w, torch.zeros((), dtype=D))


def _stencil_1d(u):
    up = F.pad(u, (1, 1))
    return up[2:] - 2 * up[1:-1] + up[:-2] + torch.exp(u)


def _stencil_2d(u):
    g = u.view(6, 6)
    up = F.pad(g, (1, 1, 1, 1))
    lap = up[2:, 1:-1] + up[:-2, 1:-1] + up[1:-1, 2:] + up[1:-1, :-2] - 4 * g
    return (lap + g**3).reshape(-1)


W_CONV1 = _w(1, 1, 3)
W_CONV2 = _w(1, 1, 3, 3)
W_CONV_GROUPS = _w(4, 1, 3)
W_CONV_T = _w(2, 3, 3)
W_DENSE = _w(5, 12)
W_BAND = _banded(12, 1)
W_MLP = (_w(8, 3), _w(2, 8))


def _mlp_rows(x):
    h = torch.tanh(x.view(4, 3) @ W_MLP[0].T)
    return (h @ W_MLP[1].T).reshape(-1)


def _buffer_writes(x):
    y = torch.zeros(14, dtype=x.dtype)
    y[1:-1] = x
    y[1:-1] += 2 * y[2:] - y[:-2]
    return y


def _own_input_in_place(x):
    x[0] = x[1]
    x.mul_(2)
    return x.sin()


def _accumulate(x):
    idx = torch.tensor([0, 1, 1, 4, 0, 2])
    a = torch.zeros(5, dtype=x.dtype).scatter_add(0, idx, x[:6])
    b = torch.zeros(5, 2, dtype=x.dtype).index_add(0, torch.tensor([0, 1, 1, 4]), x[:8].view(4, 2))
    c = torch.zeros(5, dtype=x.dtype).index_put((torch.tensor([0, 3, 3]),), x[9:], accumulate=True)
    return torch.cat([a, b.reshape(-1), c])


def _norms(x):
    g = x.view(3, 4)
    return torch.cat([
        F.layer_norm(g, (4,)).reshape(-1),
        F.group_norm(x.view(1, 4, 3), 2).reshape(-1),
    ])


def _dot_mv_outer(x):
    return torch.cat([
        torch.dot(x[:3], x[3:6]).reshape(1),
        torch.mv(W_BAND[:4, :4], x[:4]),
        torch.outer(x[:2], x[10:]).reshape(-1),
    ])


def _slice_index_gather(x):
    return torch.cat([
        x[1:5] * x[::3],
        x[torch.tensor([3, 1, 1])],
        torch.gather(x.view(3, 4), 1, torch.tensor([[0], [3], [2]])).reshape(-1),
        x.index_select(0, torch.tensor([7, 0])),
    ])


def _pad_modes(u):
    return torch.cat([
        F.pad(u.view(1, 3, 4), (1, 1), mode="reflect").reshape(-1),
        F.pad(u.view(1, 3, 4), (2, 0), mode="replicate").reshape(-1),
        F.interpolate(u.view(1, 1, 12), scale_factor=2).reshape(-1),
    ])


def _reshape_transpose(x):
    chain = x.view(3, 4).T.reshape(-1).view(2, 6).T.reshape(-1)
    return chain**2 + x.view(3, 4).permute(1, 0).flatten().flip(0)


_BN = torch.nn.BatchNorm1d(4).double().eval()

# name -> (f, n, branches, exact). branches: f's control flow or integer values depend on x
# (the pattern is only checked at the point it was detected at). exact: the pattern equals
# the non-zeros of the Jacobian at a random point (no conservative entries).
CASES = {
    "elementwise": (lambda x: x * torch.tanh(x) + torch.sin(x), 12, False, True),
    "sum_rows": (lambda x: x.view(3, 4).sum(1), 12, False, True),
    "mean_prod_var": (lambda x: torch.cat([x.view(3, 4).mean(0), x.view(3, 4).prod(1),
                                           x.view(3, 4).var(1)]), 12, False, True),
    "softmax_logsumexp": (lambda x: torch.cat([torch.softmax(x.view(3, 4), 1).reshape(-1),
                                               torch.logsumexp(x.view(3, 4), 0)]), 12, False, True),
    "vector_norm": (lambda x: torch.linalg.vector_norm(x.view(4, 3), dim=0), 12, False, True),
    "amax": (lambda x: x.view(3, 4).amax(1), 12, True, False),
    # (values picked by their order: each depends on its whole line, at every x)
    "max_dim_sort_topk": (lambda x: torch.cat([x.view(3, 4).max(1)[0], torch.sort(x)[0],
                                               torch.topk(x, 3)[0]]), 12, False, False),
    "cumsum": (lambda x: torch.cumsum(x.view(3, 4), 1).reshape(-1), 12, False, False),
    "matmul_dense": (lambda x: torch.tanh(W_DENSE @ x), 12, False, True),
    "matmul_banded": (lambda x: W_BAND @ torch.sin(x), 12, False, True),
    "linear_rows": (lambda x: F.linear(x.view(4, 3), W_MLP[0]).reshape(-1), 12, False, True),
    "mlp_rows": (_mlp_rows, 12, False, True),
    "bmm_einsum": (lambda x: torch.einsum("bij,bjk->bik", x.view(2, 2, 3), x.view(2, 3, 2))
                   .reshape(-1), 12, False, True),
    "dot_mv_outer": (_dot_mv_outer, 12, False, True),
    "slice_index_gather": (_slice_index_gather, 12, False, True),
    "cat_stack": (lambda x: torch.cat([x[:3], torch.stack([x[5], x[4] * 2]),
                                       torch.zeros(2, dtype=D)]), 12, False, True),
    "stencil_1d_slicing": (_stencil_1d, 12, False, True),
    "stencil_1d_conv1d": (lambda u: F.conv1d(u.view(1, 1, 12), W_CONV1, padding=1).reshape(-1)
                          + u**2, 12, False, True),
    "stencil_2d_slicing": (_stencil_2d, 36, False, True),
    "stencil_2d_conv2d": (lambda u: torch.tanh(F.conv2d(u.view(1, 1, 6, 6), W_CONV2, padding=1))
                          .reshape(-1), 36, False, True),
    "conv_strided_dilated": (lambda u: torch.cat([
        F.conv2d(u.view(1, 1, 6, 6), W_CONV2, stride=2, padding=1).reshape(-1),
        F.conv1d(u.view(1, 1, 36), W_CONV1, dilation=3, padding=3).reshape(-1)]), 36, False, True),
    "conv_groups": (lambda u: F.conv1d(u.view(1, 2, 6), W_CONV_GROUPS, padding=1, groups=2)
                    .reshape(-1), 12, False, True),
    "conv_transpose": (lambda u: F.conv_transpose1d(u.view(1, 2, 6), W_CONV_T, stride=2,
                                                    padding=1, output_padding=1).reshape(-1),
                       12, False, True),
    "pad_modes": (_pad_modes, 12, False, True),
    "reshape_transpose": (_reshape_transpose, 12, False, True),
    # (by a condition computed from x: both branches, at every x)
    "where_masked_fill": (lambda x: torch.where(x > 0, x, x.flip(0)) + x.masked_fill(x < 0, 1.0),
                          12, False, False),
    "tril_roll_repeat": (lambda x: torch.cat([torch.tril(x.view(3, 4)).reshape(-1) ** 2,
                                              torch.roll(x, 2), x[:2].repeat(3)]), 12, False, True),
    "in_place_buffer": (_buffer_writes, 12, False, True),
    "in_place_own_input": (_own_input_in_place, 12, False, True),
    "accumulating_scatters": (_accumulate, 12, False, True),
    "norms": (_norms, 12, False, True),
    "batch_norm_eval": (lambda x: _BN(x.view(3, 4)).reshape(-1), 12, False, True),
    "constant_output": (lambda x: torch.cat([W_DENSE[0, :3], x[:2]]), 12, False, True),
    "no_rule_fft": (lambda x: torch.fft.rfft(x).abs() + 0 * x[:7], 12, False, False),
    "no_rule_solve": (lambda x: torch.linalg.solve(W_BAND[:4, :4] + 4 * torch.eye(4, dtype=D),
                                                   x[:4]) * x[4:8], 12, False, False),
}
NO_RULE = {"no_rule_fft", "no_rule_solve"}


def _dense(pattern: torch.Tensor) -> torch.Tensor:
    return pattern.to_dense().bool()


def _jac(f, x):
    x = x.clone()  # (some cases write into their input)
    return torch.func.jacfwd(f)(x).reshape(-1, x.numel())


@pytest.fixture(autouse=True)
def _fresh_plans():
    clear_cache()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=JacobianWarning, message=".*no sparsity rule")
        yield
    clear_cache()


@pytest.mark.parametrize("name", list(CASES))
def test_pattern_holds_every_nonzero_on_random_points(name):
    f, n, branches, exact = CASES[name]
    first = None
    for seed in range(3):
        x = torch.randn(n, dtype=D, generator=torch.Generator().manual_seed(seed))
        pattern = jacobian_sparsity(f, x)
        assert pattern.layout is torch.sparse_coo and pattern.dtype is torch.bool
        assert pattern.is_coalesced()
        got = _dense(pattern)
        nonzero = _jac(f, x) != 0
        assert got.shape == nonzero.shape
        missed = (nonzero & ~got).nonzero().tolist()
        assert not missed, f"{name}: entries missing from the pattern: {missed[:5]}"
        if exact:
            assert torch.equal(got, nonzero), f"{name}: the pattern has extra entries"
        if not branches:  # the structure does not depend on the point
            if first is None:
                first = got
            assert torch.equal(got, first)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
def test_values_equal_jacfwd(name, mode):
    f, n, _, _ = CASES[name]
    if name == "in_place_own_input" and mode != "fwd":
        pytest.skip("torch.func.vjp refuses writes into its input (a leaf that requires grad)")
    x = torch.randn(n, dtype=D)
    J = sparse_jacobian(f, x, mode=mode)
    assert J.layout is torch.sparse_csr and J.shape == _jac(f, x).shape
    torch.testing.assert_close(J.to_dense(), _jac(f, x))


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo, torch.sparse_csc,
                                    torch.strided], ids=str)
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_layouts(layout, mode):
    f = _stencil_2d
    x = torch.randn(36, dtype=D)
    J = sparse_jacobian(f, x, layout=layout, mode=mode)
    assert J.layout is layout and J.dtype is D
    dense = J if layout is torch.strided else J.to_dense()
    torch.testing.assert_close(dense, _jac(f, x))
    if layout is torch.sparse_coo:
        assert J.is_coalesced()


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4, 7, 10, 1000])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_chunks(chunk_size, mode):
    x = torch.randn(36, dtype=D)
    J = sparse_jacobian(_stencil_2d, x, mode=mode, chunk_size=chunk_size)
    torch.testing.assert_close(J.to_dense(), _jac(_stencil_2d, x))


def test_max_memory_chunks_and_refuses():
    x = torch.randn(36, dtype=D)
    J = sparse_jacobian(_stencil_2d, x, max_memory=40_000)
    torch.testing.assert_close(J.to_dense(), _jac(_stencil_2d, x))
    with pytest.raises(JacobianMemoryError, match=r"structural non-zeros of a 36 x 36 "
                                                  r"Jacobian.*max_memory=100 B"):
        sparse_jacobian(_stencil_2d, x, max_memory=100)


def test_pytrees_rows_and_columns_are_concatenated_leaves():
    def f(inputs):
        a, b = inputs["a"], inputs["b"]
        return (a * b.reshape(-1)[:3], {"s": a.sum().reshape(1), "b": b.flip(0)})

    x = {"a": torch.randn(3, dtype=D), "b": torch.randn(2, 2, dtype=D)}
    J = sparse_jacobian(f, x)
    assert J.shape == (3 + 1 + 4, 3 + 4)

    def flat(v):
        out = f({"a": v[:3], "b": v[3:].view(2, 2)})
        return torch.cat([out[0], out[1]["s"], out[1]["b"].reshape(-1)])

    v = torch.cat([x["a"], x["b"].reshape(-1)])
    torch.testing.assert_close(J.to_dense(), torch.func.jacfwd(flat)(v))
    assert torch.equal(_dense(jacobian_sparsity(f, x)), torch.func.jacfwd(flat)(v) != 0)


def test_float32_and_mixed_output_dtype():
    x = torch.randn(12)
    J = sparse_jacobian(_stencil_1d, x)
    assert J.dtype is torch.float32
    torch.testing.assert_close(J.to_dense(), _jac(_stencil_1d, x))


# ---- colourings ---------------------------------------------------------------------------


def _random_pattern(m, n, density, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(m, n, generator=g) < density
    r, c = dense.nonzero(as_tuple=True)
    return Pattern(m, n, r, c), dense


@pytest.mark.parametrize("seed", range(8))
def test_colourings_are_valid_on_random_patterns(seed):
    p, dense = _random_pattern(17 + seed, 23 - seed, 0.05 + 0.05 * seed, seed)
    for coloring, matrix in ((color_columns(p), dense), (color_rows(p), dense.T)):
        assert is_valid(p, coloring)
        colors = coloring.colors
        used = (matrix.sum(0) > 0)  # vertices (columns of matrix) with a non-zero
        assert bool((colors[used] >= 0).all()) and bool((colors[~used] == -1).all())
        for c in range(coloring.count):  # no two vertices of one colour share a net
            assert int(matrix[:, colors == c].sum(1).max()) <= 1
        assert coloring.count >= int(matrix.sum(1).max())  # the lower bound


@pytest.mark.parametrize("name", ["stencil_1d_slicing", "stencil_2d_slicing", "mlp_rows",
                                  "matmul_banded", "elementwise"])
def test_colourings_of_the_cases_are_valid_and_small(name):
    f, n, _, _ = CASES[name]
    x = torch.randn(n, dtype=D)
    prob = Problem(f, (x,), 0, has_aux=False, call="t", detached=True)
    plan = compute.lookup_plan(prob, lambda: _pattern_of(f, x))
    for mode in ("fwd", "rev"):
        coloring = plan.coloring(mode)
        assert is_valid(plan.pattern, coloring)
    expected = {"stencil_1d_slicing": 3, "mlp_rows": 3, "matmul_banded": 3, "elementwise": 1,
                "stencil_2d_slicing": 7}[name]
    assert plan.coloring("fwd").count <= expected


def _pattern_of(f, x):
    from torch_vjp._sparse.detect import detect

    return detect(Problem(f, (x,), 0, has_aux=False, call="t", detached=True))


def test_greedy_invalid_colouring_is_caught():
    p, _ = _random_pattern(6, 6, 0.5, 0)
    good = color_columns(p)
    bad = type(good)("fwd", torch.zeros_like(good.colors), 1, "natural")
    assert good.count > 1 and not is_valid(p, bad)
    assert greedy([0, 1, 3, 4], [0, 0, 1, 1], 2, [2, 1, 0]) == [0, 1, 0]


def _plan_of(f, x):
    return compute.cached_plan(Problem(f, (x,), 0, has_aux=False, call="t"))


def test_auto_picks_fewer_colours():
    # a dense row (a sum) over a diagonal: every column meets the dense row, so forward mode
    # needs n colours, reverse mode 2
    f = lambda x: torch.cat([x.sum().reshape(1), x.sin()])  # noqa: E731
    x = torch.randn(10, dtype=D)
    sparse_jacobian(f, x)
    plan = _plan_of(f, x)
    assert plan.coloring("fwd").count == 10 and plan.coloring("rev").count == 2
    assert plan.coloring("auto").mode == "rev"
    g = lambda x: x[0] * x  # noqa: E731  a dense column: reverse mode needs n colours
    sparse_jacobian(g, x)
    assert _plan_of(g, x).coloring("auto").mode == "fwd"
    h = lambda x: x.roll(1) - x  # noqa: E731  2 colours either way: reverse on a tie
    sparse_jacobian(h, x)
    assert _plan_of(h, x).coloring("auto").mode == "rev"


# ---- caching and user patterns --------------------------------------------------------------


class _Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_second_call_does_no_detection(monkeypatch):
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    calls = []

    def f(u):
        calls.append(1)
        return _stencil_1d(u)

    x = torch.randn(12, dtype=D)
    sparse_jacobian(f, x)
    first = len(calls)
    J = sparse_jacobian(f, x + 1)
    assert detections.calls == 1
    # the second call runs f only for the products (the first also detected, checked the
    # products against one reverse product: NOTE [auto, checked once], and against one
    # forward product: NOTE [reverse products, checked on first use], and one of each and
    # one vectorised near x: NOTE [checked near the point])
    assert len(calls) - first == first - 6
    torch.testing.assert_close(J.to_dense(), _jac(_stencil_1d, x + 1))
    sparse_jacobian(f, torch.randn(13, dtype=D))  # another shape: detected again
    sparse_jacobian(f, torch.randn(12))  # another dtype: detected again
    assert detections.calls == 3
    clear_cache(f)
    sparse_jacobian(f, x)
    assert detections.calls == 4


def test_bound_methods_share_their_plan(monkeypatch):
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    model = torch.nn.Conv1d(1, 1, 3, padding=1).double()
    x = torch.randn(1, 1, 10, dtype=D)
    for _ in range(3):
        J = sparse_jacobian(model.forward, x)
    assert detections.calls == 1
    torch.testing.assert_close(J.to_dense(), _jac(model, x))


class _Pruned(torch.nn.Module):
    """A linear layer whose weight is computed in forward (weight * mask, as pruning does)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6, 6, dtype=D))
        self.register_buffer("mask", torch.ones(6, 6, dtype=D).triu())

    def forward(self, x):
        return torch.tanh((self.weight * self.mask) @ x)


def _zero_head():
    lin = torch.nn.Linear(6, 6).double()
    with torch.no_grad():
        lin.weight.zero_()  # (a zero-initialised last layer)
    return lin


def _changed(module, how):
    new = torch.randn(6, 6, dtype=D, generator=torch.Generator().manual_seed(3))
    if how == "in_place":  # (an optimizer's step)
        with torch.no_grad():
            module.weight.add_(new)
    elif how == "load_state_dict":
        module.load_state_dict({**module.state_dict(), "weight": new})
    elif how == "data":  # .data =: another storage, the same version
        module.weight.data = new
    elif how == "data_in_place":  # (a target network's update): the same version
        module.weight.data.copy_(new)
    elif how == "numpy":  # the same version
        module.weight.detach().numpy()[:] = new.numpy()
    else:  # rebound: the old parameter lives on (an optimizer holds it), unchanged
        old = module.weight
        module.weight = torch.nn.Parameter(new)
        return old
    return None


@pytest.mark.parametrize("how", ["in_place", "load_state_dict", "data", "rebound",
                                 "data_in_place", "numpy"])
@pytest.mark.parametrize("make", [_zero_head, _Pruned], ids=["zero_head", "pruned"])
def test_a_weight_whose_zeros_moved_is_detected_again(make, how, monkeypatch):
    # the zeros of a module's weight were taken as structural and the plan cached: once the
    # weight was trained (or loaded), the entries of the zeros that moved were silently
    # missing from every later sparse Jacobian of the same module
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    module = make()
    x = torch.randn(6, dtype=D)
    sparse_jacobian(module, x)
    sparse_jacobian(module, x)
    assert detections.calls == 1  # (nothing changed: the plan is kept)
    old = _changed(module, how)
    J = sparse_jacobian(module, x, layout=torch.strided)
    del old
    assert detections.calls == 2
    torch.testing.assert_close(J, torch.func.jacrev(module)(x))
    if make is _Pruned:  # (the mask's zeros stay structural)
        assert not J[torch.ones(6, 6, dtype=torch.bool).tril(-1)].any()


def test_a_buffer_rebound_since_is_detected_again(monkeypatch):
    # the plan key leaves buffers out, and the old buffer died: a dead guard changed
    # nothing, so the plan of the old mask's zeros was kept, silently wrong
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    module = _Pruned()
    with torch.no_grad():
        module.weight.normal_()
    x = torch.randn(6, dtype=D)
    sparse_jacobian(module, x)
    sparse_jacobian(module, x)
    assert detections.calls == 1
    module.mask = torch.ones(6, 6, dtype=D).tril()  # (the old mask dies)
    J = sparse_jacobian(module, x, layout=torch.strided)
    assert detections.calls == 2
    torch.testing.assert_close(J, torch.func.jacrev(module)(x))
    sparse_jacobian(module, x)
    assert detections.calls == 2


class _MaskedAttr(torch.nn.Module):
    # a mask kept as a plain tensor attribute (not registered), or as a buffer
    def __init__(self, registered):
        super().__init__()
        mask = torch.eye(6, dtype=D)
        if registered:
            self.register_buffer("mask", mask)
        else:
            self.mask = mask

    def forward(self, x):
        return (self.mask * 2.0) @ x


class _InPlainList(torch.nn.Module):
    # a submodule held in a plain list attribute: nn.Module does not register it
    def __init__(self, registered):
        super().__init__()
        self.blocks = [_MaskedAttr(registered)]

    def forward(self, x):
        return self.blocks[0](x)


class _Callable:
    def __init__(self, registered):
        self.mask = torch.eye(6, dtype=D)

    def __call__(self, x):
        return (self.mask * 2.0) @ x


@pytest.mark.parametrize("holder", ["module attribute", "list buffer", "list attribute",
                                    "callable object"])
def test_a_guard_rebound_where_it_lives_is_detected_again(holder):
    # only a buffer of a module that Module.modules() finds was watched where it lives: a
    # mask rebound as a plain tensor attribute, in a module held in a plain list, or on a
    # callable object let the old mask die, and the old plan was kept, silently wrong
    make, registered = {"module attribute": (_MaskedAttr, False),
                        "list buffer": (_InPlainList, True),
                        "list attribute": (_InPlainList, False),
                        "callable object": (_Callable, False)}[holder]
    f = make(registered)
    owner = f.blocks[0] if isinstance(f, _InPlainList) else f
    x = torch.randn(6, dtype=D)
    sparse_jacobian(f, x)
    owner.mask = torch.eye(6, dtype=D).roll(1, 1)  # (the old mask dies)
    J = sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(J, 2.0 * torch.eye(6, dtype=D).roll(1, 1))


@pytest.mark.parametrize("write", ["in_place", "inference_mode"])
def test_a_constant_made_in_inference_mode_guards_the_plan(write, monkeypatch):
    # an inference tensor counts no versions: guarding the plan by its _version raised
    # RuntimeError (Inference tensors do not track version counter) out of every call
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    with torch.inference_mode():
        W = torch.eye(6, dtype=D) + torch.eye(6, dtype=D).roll(1, 1)
    f = lambda u: torch.tanh(W @ u)  # noqa: E731
    x = torch.randn(6, dtype=D)
    sparse_jacobian(f, x)
    sparse_jacobian(f, x)
    assert detections.calls == 1
    with torch.inference_mode():
        W.fill_(1.0)
    J = sparse_jacobian(f, x, layout=torch.strided)
    assert detections.calls == 2
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))


def test_a_weight_with_a_nan_keeps_its_plan(monkeypatch):
    # (values are compared: NaN must equal NaN, or every call would detect again)
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    W = torch.eye(6, dtype=D)
    W[0, 3] = float("nan")
    f = lambda u: W @ u  # noqa: E731
    x = torch.randn(6, dtype=D)
    sparse_jacobian(f, x)
    sparse_jacobian(f, x)
    assert detections.calls == 1


class _Cfg:
    shift = 0


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("where", ["list", "attribute", "closure"])
def test_a_branch_on_state_outside_the_key_is_detected_again(mode, where, monkeypatch):
    # NOTE [a cached plan, probed]: f branched on a flag its plan's key does not see (a
    # list item, an object's attribute, a number in a closure); the plan of the first
    # branch was used on the second, silently 0.94 off
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    flag, cfg, shift = [0], _Cfg(), 0

    def f(u):
        s = {"list": flag[0], "attribute": cfg.shift, "closure": shift}[where]
        return torch.tanh(u.roll(s)) * u

    def set_shift(k):
        nonlocal shift
        flag[0] = cfg.shift = shift = k

    x = torch.randn(7, dtype=D)
    # (back to shift 0: its pattern, the diagonal, is inside the kept one: right as it is)
    for k, calls in ((0, 1), (0, 1), (2, 2), (2, 2), (0, 2), (1, 3)):
        set_shift(k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
        torch.testing.assert_close(J, torch.func.jacrev(f)(x))
        assert detections.calls == calls, (k, calls)


def test_a_changed_branch_warns_once_naming_the_function_and_the_fix():
    flag = [0]
    f = lambda u: torch.tanh(u.roll(flag[0])) * u  # noqa: E731
    x = torch.randn(5, dtype=D)
    sparse_jacobian(f, x)
    flag[0] = 1
    with pytest.warns(tv.JacobianWarning, match=r"(?s)sparse_jacobian: the Jacobian of "
                      r"\S*<lambda> has entries outside the sparsity pattern detected on an "
                      r"earlier call: f took another branch.*pass pattern= one that covers "
                      r"every branch"):
        sparse_jacobian(f, x)
    flag[0] = 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        torch.testing.assert_close(sparse_jacobian(f, x, layout=torch.strided),
                                   torch.func.jacrev(f)(x))


class _Squares(torch.autograd.Function):
    # a backward that is not linear in its cotangent: products with 0/1 seeds and with the
    # probe row do not combine
    @staticmethod
    def forward(u):
        return u * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * g


def test_products_not_linear_in_their_seeds_detect_once_more_then_keep_the_plan(monkeypatch):
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    f = lambda u: _Squares.apply(u)[:4] + u[1:5]  # noqa: E731
    x = torch.randn(6, dtype=D)
    first = sparse_jacobian(f, x, mode="rev", layout=torch.strided)
    assert detections.calls == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)  # (the same pattern: no warning)
        second = sparse_jacobian(f, x, mode="rev", layout=torch.strided)
        assert detections.calls == 2  # the probe disagreed; detecting again found the same
        third = sparse_jacobian(f, x, mode="rev", layout=torch.strided)
    assert detections.calls == 2  # and the plan is no longer probed
    torch.testing.assert_close(second, first)
    torch.testing.assert_close(third, first)


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float64, torch.float32),
                                               (torch.float32, torch.float64)])
def test_the_probe_of_an_f_whose_output_dtype_is_not_xs_agrees(mode, x_dtype, out_dtype,
                                                                 monkeypatch):
    # the seeds held the probe row in their dtype (x's in forward mode, the output's in
    # reverse mode), the weights read it in the products' (the other one), and the
    # products were compared within the products' dtype's tolerance: a float32 row read
    # as float64 numbers, or a float32 product returned in float64, disagreed by float32's
    # rounding, under float64's tolerance. Every second call detected again, found the
    # same pattern and stopped probing the plan, so that a later branch was gathered
    # wrong, silently (2.3 off)
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    flag = [1]
    f = lambda u: (u.roll(flag[0]) * u * 3).to(out_dtype)  # noqa: E731
    x = torch.randn(64, dtype=x_dtype, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        sparse_jacobian(f, x, mode=mode)
    assert detections.calls == 1
    flag[0] = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
    assert detections.calls == 2
    want = torch.func.jacrev(f)(x).to(J.dtype)
    torch.testing.assert_close(J, want)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_a_users_pattern_not_probed_for_one_function_is_still_probed_for_another(mode):
    # the probe was turned off per pattern: after a function whose products are not linear
    # in their seeds (its probe disagreed, the pattern not to blame), another function
    # with the same pattern tensor, which leaves out its entries, got row sums (2.2 off),
    # silently
    x = torch.randn(5, dtype=D)
    diag = torch.eye(5, dtype=torch.bool)
    g = lambda u: _Squares.apply(u)  # noqa: E731
    f = lambda u: u * u.roll(1)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        sparse_jacobian(g, x, pattern=diag, mode="rev")
        sparse_jacobian(g, x, pattern=diag, mode="rev")
        with pytest.raises(tv.JacobianOptionError, match="pattern leaves out non-zeros"):
            sparse_jacobian(f, x, pattern=diag, mode=mode)


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("dtype,big", [(torch.float32, 1e3), (torch.float64, 1e8)])
def test_a_changed_branch_in_rows_much_smaller_than_others_is_detected(mode, dtype, big):
    # the probe compared its products within sqrt(eps) of their largest element: rows a
    # thousand times smaller than others (float32; 1e8 in float64), another branch there
    # went unseen and those rows came out wrong by all they hold, silently
    flag = [1]
    f = lambda u: torch.cat([big * torch.tanh(u[:8]),  # noqa: E731
                             torch.tanh(u[8:].roll(flag[0])) * u[8:]])
    x = torch.randn(16, dtype=dtype, generator=torch.Generator().manual_seed(0))
    sparse_jacobian(f, x, mode=mode)
    sparse_jacobian(f, x, mode=mode)
    flag[0] = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
def test_the_probe_of_outputs_of_two_dtypes_agrees(mode, monkeypatch):
    # a float32 output beside a float64 one: the probe was judged within float64's
    # tolerance (reverse mode: the float64 row fed to the float32 output too), disagreed
    # on every plan's first probe, and the plan was no longer probed
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    flag = [1]
    f = lambda u: (u * u.roll(flag[0]), (torch.tanh(u) * 3).float())  # noqa: E731
    x = torch.randn(64, dtype=D, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        sparse_jacobian(f, x, mode=mode)
    assert detections.calls == 1
    flag[0] = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
    assert detections.calls == 2
    want = torch.cat([t.reshape(64, 64).to(D) for t in torch.func.jacrev(f)(x)])
    torch.testing.assert_close(J.to(D), want, rtol=1e-5, atol=1e-6)


def test_which_calls_add_the_probe_row(monkeypatch):
    # (NOTE [a cached plan, probed]: every call but a plan's first; a user's pattern from
    # its first call in an explicit mode)
    f = lambda u: u * u.roll(1)  # noqa: E731
    x = torch.randn(5, dtype=D)
    diag = torch.eye(5, dtype=torch.bool) | torch.eye(5, dtype=torch.bool).roll(-1, 1)
    plan_calls = []
    orig = compute.compressed

    def spy(*args, **kwargs):
        plan_calls.append(kwargs.get("probe", False))
        return orig(*args, **kwargs)

    import torch_vjp.sparse as sp

    monkeypatch.setattr(sp, "compressed", spy)
    for _ in range(2):
        sparse_jacobian(f, x, pattern=diag, mode="fwd")
    assert plan_calls == [True, True]
    plan_calls.clear()
    # (a detected plan is: its second call adds the probe row)
    sparse_jacobian(f, x, mode="fwd")
    sparse_jacobian(f, x, mode="fwd")
    assert plan_calls == [False, True]


@pytest.mark.parametrize("mode", ["fwd", "rev", "auto"])
def test_a_users_pattern_that_leaves_out_entries_is_refused_in_every_mode(mode):
    # the explicit modes used to compute what such a pattern said: the sums of the entries
    # sharing a colour, silently (here row sums for the diagonal, 3.4 off); "auto" checked
    # its first call only
    f = lambda u: u * u.roll(1)  # noqa: E731
    x = torch.randn(5, dtype=D)
    diag = torch.eye(5, dtype=torch.bool)
    with pytest.raises(tv.JacobianOptionError, match=r"(?s)pattern leaves out non-zeros of "
                       r"the Jacobian.*Fix: pass a pattern that holds every entry") as info:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            sparse_jacobian(f, x, pattern=diag, mode=mode)
            sparse_jacobian(f, x, pattern=diag, mode=mode)  # ("auto": the call after)
    # (by the probe row, in every mode: "auto"'s first call with a user's pattern adds it
    # too, before its check)
    said = "disagrees with one more product of f, computed with the others for a check"
    assert said in str(info.value)


@pytest.mark.parametrize("read", ["item", "bool", "tolist"])
def test_a_branch_on_a_value_of_a_buffer_changed_since_is_detected_again(read, monkeypatch):
    # f branched on a tensor it closes over (a step counter); the plan of the first branch
    # was kept after the counter changed in place, and later calls were silently wrong
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    step = torch.zeros((), dtype=torch.int64)
    value = {"item": lambda: step.item(), "bool": lambda: bool(step),
             "tolist": lambda: step.tolist()}[read]

    def f(u):
        return u * u.roll(1) if value() > 0 else u * 2

    x = torch.randn(6, dtype=D)
    sparse_jacobian(f, x)
    sparse_jacobian(f, x)
    assert detections.calls == 1
    step.add_(1)
    J = sparse_jacobian(f, x, layout=torch.strided)
    assert detections.calls == 2
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))


@pytest.mark.parametrize("op", ["index", "where", "index_add", "derived_index"])
def test_an_index_or_mask_changed_in_place_since_is_detected_again(op, monkeypatch):
    # the values of an integer or boolean tensor f closes over place x's elements (a
    # permutation buffer, a boundary mask): reshuffled in place, the plan of the old
    # placement was kept and later sparse Jacobians were silently wrong
    import torch_vjp.sparse as sp

    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    perm = torch.tensor([1, 2, 3, 4, 5, 0])
    mask = torch.tensor([True, False, True, False, True, False])
    f = {"index": lambda u: u[perm] * u,
         "where": lambda u: torch.where(mask, u, u.roll(1)),
         "index_add": lambda u: torch.zeros_like(u).index_add(0, perm, u.roll(2)),
         "derived_index": lambda u: u[(perm * 5) % 6] * u}[op]
    x = torch.randn(6, dtype=D)
    sparse_jacobian(f, x)
    sparse_jacobian(f, x)
    assert detections.calls == 1
    perm.copy_(perm.roll(2))
    mask.copy_(mask.roll(1))
    J = sparse_jacobian(f, x, layout=torch.strided)
    assert detections.calls == 2
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))


def test_plans_kept_per_function_are_bounded():
    # (the key holds which tensors a module's parameters are: one rebound on every call
    # makes a key per call)
    class Rebinds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4, dtype=D))

        def forward(self, x):
            self.scale = torch.nn.Parameter(self.scale.detach().clone())  # (new per call)
            return x * x.roll(1) * self.scale

    module = Rebinds()
    x = torch.randn(4, dtype=D)
    for _ in range(compute._PLANS_PER_FUNCTION + 8):
        J = sparse_jacobian(module, x)
    plans, _ = compute._slot(module, create=False)
    assert len(plans) == compute._PLANS_PER_FUNCTION
    torch.testing.assert_close(J.to_dense(), _jac(module, x))


def test_a_changed_output_size_is_detected_again():
    size = [4]
    f = lambda x: x[: size[0]] * 2  # noqa: E731
    x = torch.randn(6, dtype=D)
    assert sparse_jacobian(f, x).shape == (4, 6)
    size[0] = 5
    J = sparse_jacobian(f, x)
    torch.testing.assert_close(J.to_dense(), _jac(f, x))


@pytest.mark.parametrize("kind", ["detected", "dense_bool", "csr", "csc", "superset"])
def test_user_pattern_skips_detection(kind, monkeypatch):
    import torch_vjp.sparse as sp

    x = torch.randn(36, dtype=D)
    detected = jacobian_sparsity(_stencil_2d, x)
    pattern = {
        "detected": detected,
        "dense_bool": detected.to_dense(),
        "csr": detected.to_dense().double().to_sparse_csr(),
        "csc": detected.to_dense().double().to_sparse_csc(),
        "superset": torch.ones(36, 36, dtype=torch.bool),
    }[kind]
    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    colourings = _Counter(compute.color_rows)
    monkeypatch.setattr(compute, "color_rows", colourings)
    for _ in range(2):
        J = sparse_jacobian(_stencil_2d, x, pattern=pattern, mode="rev")
        torch.testing.assert_close(J.to_dense(), _jac(_stencil_2d, x))
    assert detections.calls == 0 and colourings.calls == 1  # kept with the pattern


def test_auto_refuses_a_user_pattern_that_leaves_out_non_zeros(monkeypatch):
    # mode="auto" checks its products against a reverse product once; where no mode agreed
    # it returned the wrong Jacobian with a warning that blamed a random or non-smooth f
    # (the check alone: the probe row off, as where a function turned it off for the
    # pattern; the probe row, on by default, refuses it first)
    monkeypatch.setattr(compute.Plan, "probes", lambda self, key: False)
    f = lambda u: u + 0.5 * u.roll(1)  # noqa: E731
    x = torch.randn(12, dtype=D)
    pattern = torch.eye(12, dtype=torch.bool)  # (the sub-diagonal left out)
    with pytest.raises(JacobianOptionError, match=(
            r"^torch_vjp\.sparse_jacobian: pattern leaves out non-zeros of the Jacobian: the "
            r"Jacobian computed with it disagrees with a reverse product of f by up to "
            r"[0-9.e+-]+ \(at a scale of [0-9.e+-]+\) in every mode, while f's reverse "
            r"products are those of one linear map \(deterministic and additive in the "
            r"cotangent\)\. An entry the pattern leaves out is not computed, and spoils the "
            r"entries that share its colour, so the result would be wrong\.\n  Fix: pass a "
            r"pattern that holds every entry that can be non-zero "
            r"\(torch_vjp\.jacobian_sparsity\(f, x\) detects one")):
        sparse_jacobian(f, x, pattern=pattern)
    full = pattern | _dense(jacobian_sparsity(f, x))  # (the fix the message names)
    torch.testing.assert_close(sparse_jacobian(f, x, pattern=full).to_dense(), _jac(f, x))


@pytest.mark.parametrize("user_pattern", [False, True])
def test_auto_inside_inference_mode_is_not_checked_against_nothing(user_pattern):
    # plain autograd records nothing in inference mode: the check's reverse product was all
    # zeros, every mode "disagreed" with it, and auto warned that f is random or not smooth
    f = lambda u: u * u.roll(1)  # noqa: E731
    with torch.inference_mode():
        x = torch.randn(6, dtype=D)
        pattern = jacobian_sparsity(f, x) if user_pattern else None
        with warnings.catch_warnings():
            warnings.simplefilter("error", JacobianWarning)
            J = sparse_jacobian(f, x, pattern=pattern, layout=torch.strided)
    torch.testing.assert_close(J, _jac(f, x.clone()))


def _clamped_gradient(u):
    h = u * u.roll(1)
    if h.requires_grad:  # (a hook that clamps the gradient: a backward not linear in it)
        h.register_hook(lambda g: g.clamp(-0.1, 0.1))
    return h.sin()


@pytest.mark.parametrize("case", ["random", "clamped_gradient"])
def test_auto_keeps_a_user_pattern_where_no_mode_can_agree(case):
    # (a random f, or a backward that is not linear in its cotangent, disagrees with any
    # reverse product: that says nothing about the pattern)
    torch.manual_seed(0)
    drop = torch.nn.Dropout(0.5).train()
    f = {"random": lambda u: drop(u * u.roll(1)), "clamped_gradient": _clamped_gradient}[case]
    x = torch.randn(12, dtype=D)
    pattern = torch.eye(12, dtype=torch.bool) | torch.eye(12, dtype=torch.bool).roll(-1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", JacobianWarning)
        J = sparse_jacobian(f, x, pattern=pattern, layout=torch.strided)
    assert not J[~pattern].any()


def test_a_modified_dense_pattern_is_coloured_again():
    x = torch.randn(6, dtype=D)
    pattern = torch.eye(6, dtype=torch.bool)
    J = sparse_jacobian(torch.sin, x, pattern=pattern)
    torch.testing.assert_close(J.to_dense(), torch.diag(x.cos()))
    pattern[0, 1] = True
    J = sparse_jacobian(lambda u: u.sin() + u[1] * torch.eye(6, dtype=D)[0], x, pattern=pattern)
    assert J.values().numel() == 7


def test_a_hybrid_coo_pattern_is_read_by_its_entries():
    # x.to_sparse(1): sparse rows, each a dense row of values; it raised a raw IndexError
    f = lambda u: u * u.roll(1)  # noqa: E731
    x = torch.randn(5, dtype=D)
    want = torch.func.jacrev(f)(x)
    for dtype in (torch.bool, D):
        pattern = want.ne(0).to(dtype).to_sparse(1)
        assert pattern.dense_dim() == 1
        J = sparse_jacobian(f, x, pattern=pattern)
        assert J.values().numel() == int(want.ne(0).sum())
        torch.testing.assert_close(J.to_dense(), want)


@pytest.mark.parametrize("layout", ["coo", "csr", "csc"])
def test_a_sparse_pattern_whose_values_are_changed_in_place_is_read_again(layout):
    # the plan kept with a sparse pattern tensor ignored writes into its values: an entry
    # turned on in place was left out of the next Jacobian (an error of 4.0, silently)
    def f(x):
        return x * x.roll(1)

    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)
    ref = torch.func.jacrev(f)(x)
    convert = {"coo": lambda t: t.to_sparse(), "csr": lambda t: t.to_sparse_csr(),
               "csc": lambda t: t.to_sparse_csc()}[layout]
    # (every entry stored: the values run row by row, column by column for csc)
    pattern = convert(torch.ones(4, 4, dtype=D))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        assert sparse_jacobian(f, x, pattern=pattern, mode="fwd").values().numel() == 16
        want = ref.ne(0).to(D)
        pattern.values().copy_((want if layout != "csc" else want.T).reshape(-1))
        assert torch.equal(pattern.to_dense().ne(0), ref.ne(0))
        J = sparse_jacobian(f, x, pattern=pattern, mode="fwd")
    # (the entries of the pattern as it is now, not as it was: 8, not 16)
    assert J.values().numel() == int(ref.ne(0).sum())
    torch.testing.assert_close(J.to_dense(), ref)
    # an entry turned off in place, which the Jacobian has: the check of the next call
    # finds it left out (before, the Jacobian was silently 4.0 off)
    pattern.values().copy_(torch.eye(4, dtype=D).reshape(-1))
    with pytest.raises(tv.JacobianOptionError, match="pattern leaves out non-zeros"):
        sparse_jacobian(f, x, pattern=pattern, mode="fwd")


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_a_dense_pattern_changed_without_a_version_is_read_again(how):
    # a pattern made by torch.from_numpy whose array changed (or written through .data)
    # bumps no version: the plan of the old pattern was kept, an entry silently left out
    def f(x):
        return x * x.roll(1)

    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)
    ref = torch.func.jacrev(f)(x)
    array = np.ones((4, 4), dtype=bool)
    pattern = torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        assert sparse_jacobian(f, x, pattern=pattern, mode="fwd").values().numel() == 16
        if how == "numpy":
            array[:] = ref.ne(0).numpy()
        else:
            pattern.data.copy_(ref.ne(0))
        J = sparse_jacobian(f, x, pattern=pattern, mode="fwd")
    # (the entries of the pattern as it is now, not as it was)
    assert J.values().numel() == int(ref.ne(0).sum())
    torch.testing.assert_close(J.to_dense(), ref)


_SUPERSETS = {
    "where": lambda x: torch.where(x > 0, x, 0.0),
    "masked_fill": lambda x: x.masked_fill(x < 0, 0.0),
    "leaky": lambda x: torch.where(x > 0, x, 0.01 * x),
    "max_dim": lambda x: x.view(4, 4).max(1).values,
    "sort": lambda x: x.sort().values,
    "topk": lambda x: x.topk(3).values,
    "cummax": lambda x: x.cummax(0).values,
}
_BY_VALUE = {
    "index_by_argmax": lambda x: x[x.view(4, 4).argmax(1)],
    "branch": lambda x: x.roll(1) * x if x.sum() > 0 else x.roll(-1) * x,
    "gather_by_argsort": lambda x: x.gather(0, x.argsort()),
    "count_of_positives": lambda x: x.roll(1) * x if len(torch.nonzero(x[:1] > 0)) else x,
    "branch_on_tolist": lambda x: x.roll(1) * x if x.tolist()[0] > 0 else x.roll(-1) * x,
    # (a factory that reads values, not only a shape: linspace between two of x's elements)
    "index_by_linspace": lambda x: x * x[(torch.linspace(x[0].detach(), x[1].detach(), 16,
                                                         dtype=x.dtype) - 0.3).abs().argmin()],
}


def _points():
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, generator=gen, dtype=D) for _ in range(4)]
    xs[1] = -xs[0]  # (another branch for sure)
    return xs


@pytest.mark.parametrize("name", sorted(_SUPERSETS))
def test_a_condition_or_order_from_the_values_gives_a_pattern_for_every_point(name, monkeypatch):
    # where/masked_fill by a mask computed from x, and values picked by their order, gave
    # the pattern at the first point, cached and reused at others: wrong there by 1,
    # silently; the pattern now unites the branches (the whole line), detected once
    import torch_vjp.sparse as sp

    f = _SUPERSETS[name]
    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for x in _points():
            J = sparse_jacobian(f, x, layout=torch.strided)
            torch.testing.assert_close(J, torch.func.jacrev(f)(x).reshape(J.shape))
    assert detections.calls == 1


@pytest.mark.parametrize("name", sorted(_BY_VALUE))
def test_a_pattern_shaped_by_the_input_values_is_detected_at_every_point(name):
    # indices computed from x that place x's elements, or a branch on x, give a pattern of
    # that point only: it was cached and reused at other points, wrong there by 1, silently
    f = _BY_VALUE[name]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in _points():
            J = sparse_jacobian(f, x, layout=torch.strided)
            torch.testing.assert_close(J, torch.func.jacrev(f)(x).reshape(J.shape))
    told = [w for w in caught if "depends on the values of x" in str(w.message)]
    assert told and re.search(
        r"^torch_vjp\.sparse_jacobian: the sparsity pattern of <lambda> depends on the values "
        r"of x \((aten|Tensor)\.\w+ .*\): the pattern found at one x need not hold at another, so it "
        r"is detected again on every call \(one traced run of f\)\.\n  For speed, pass "
        r"pattern= a pattern that covers every case", str(told[0].message))


def _zero_the_negatives(x):
    y = torch.tanh(x).clone()
    y[x < 0] = 0
    return y


def test_a_pattern_is_still_kept_where_values_only_scale(monkeypatch):
    # a mask that multiplies (x * (x > 0)) or a mask that is a constant does not move the
    # pattern: kept, detected once
    import torch_vjp.sparse as sp

    mask = torch.arange(16) % 3 == 0
    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        for f in (lambda x: x * (x > 0), lambda x: torch.where(mask, x.roll(1), x),
                  lambda x: x * torch.where(x > 0, 1.0, 0.5),
                  lambda x: torch.cat([x.sin(), (x > 0).to(x.dtype)]),
                  lambda x: x + (x > 0).to(x.dtype).clone(),
                  lambda x: torch.softmax(x.view(4, 4) - x.view(4, 4).max(-1, keepdim=True)
                                          .values, -1).reshape(-1),
                  _zero_the_negatives,  # (y[x < 0] = 0: united, as masked_fill)
                  lambda x: x.masked_select(mask) * 2,  # (a constant mask: a fixed shape)
                  lambda x: x.gather(0, torch.zeros_like(x, dtype=torch.long)) + x):
            detections.calls = 0
            for seed in range(3):
                x = torch.randn(16, generator=torch.Generator().manual_seed(seed), dtype=D)
                J = sparse_jacobian(f, x, layout=torch.strided)
                torch.testing.assert_close(J, torch.func.jacrev(f)(x))
            assert detections.calls == 1


_A6 = _w(6, 6)
_VALUE_WEIGHTS = {
    # a 0/1 matrix computed from x multiplies: its zeros move with x
    "diag_of_mask": lambda x: torch.diag((x > 0).to(x.dtype)) @ (_A6 @ torch.tanh(x)),
    # a weight picked by x's values, no number read into Python
    "weight_by_where": lambda x: torch.where(x.sum() > 0, _w(6, 6), torch.eye(6, dtype=D)) @ x,
    # a tracked tensor some of whose elements are a mask from x
    "cat_with_mask": lambda x: torch.diag(torch.cat([x[:1], (x[1:] > 0).to(x.dtype)]))
    @ (_A6 @ torch.tanh(x)),
    # a mask from x written into a constant buffer
    "mask_in_buffer": lambda x: torch.zeros(6, 6, dtype=D).index_put_(
        (torch.arange(6), torch.arange(6)), (x > 0).to(x.dtype)) @ torch.tanh(x),
    # a convolution kernel from x's values
    "kernel_by_mask": lambda x: F.conv1d(x.view(1, 1, 6), torch.stack(
        [(x[0] > 0).to(x.dtype), x.new_ones(()), (x[0] <= 0).to(x.dtype)]).view(1, 1, 3)
    ).reshape(-1),
}


@pytest.mark.parametrize("name", sorted(_VALUE_WEIGHTS))
def test_zeros_of_a_value_computed_from_x_are_not_structural(name):
    # a 0/1 mask or a weight computed from x's values, as the other operand of a matrix
    # product or convolution, had its zeros at the first point taken as structural, and the
    # pattern was cached: at -x the Jacobian came back with non-zeros missing, silently
    f = _VALUE_WEIGHTS[name]
    x = torch.randn(6, generator=torch.Generator().manual_seed(3), dtype=D)
    for mode in ("rev", "fwd"):
        clear_cache(f)
        for point in (x, -x, x, -x):
            J = sparse_jacobian(f, point, mode=mode, layout=torch.strided)
            torch.testing.assert_close(J, torch.func.jacrev(f)(point).reshape(J.shape))


_N = 12
_BAND = _banded(_N, 1)
_RANDOM_WEIGHTS = {
    # DropConnect: dropout applied to a weight inside f; every entry is 0 or 2 W[i, j]
    "dropconnect": (lambda x: F.dropout(_BAND, 0.5, training=True) @ x,
                    lambda J: torch.isclose(J, torch.zeros((), dtype=D))
                    | torch.isclose(J, 2 * _BAND)),
    # a random permutation matrix: one 1 per row and column
    "permutation_matrix": (lambda x: torch.eye(_N, dtype=D)[torch.randperm(_N)] @ x,
                           lambda J: ((J == 0) | (J == 1)).all() & ((J != 0).sum(0) == 1).all()
                           & ((J != 0).sum(1) == 1).all()),
    # x's elements placed by a random permutation
    "permuted_x": (lambda x: 2 * x[torch.randperm(_N)],
                   lambda J: ((J == 0) | (J == 2)).all() & ((J != 0).sum(0) == 1).all()
                   & ((J != 0).sum(1) == 1).all()),
    # a random 0/1 mask as the matrix
    "random_mask": (lambda x: (torch.rand(_N, _N, dtype=D) > 0.5).to(D) @ x,
                    lambda J: (J == 0) | (J == 1)),
}


@pytest.mark.parametrize("name", sorted(_RANDOM_WEIGHTS))
def test_zeros_of_a_random_draw_are_not_structural(name):
    # a weight drawn inside f (dropout of a weight, a random permutation) counted as a
    # constant: the zeros of the detection run's draw became structural and were cached,
    # while every product drew others; the result was the Jacobian of no draw at all
    # (a permutation of the first draw's pattern is one too: the calls must also differ)
    f, is_a_draw = _RANDOM_WEIGHTS[name]
    x = torch.randn(_N, generator=torch.Generator().manual_seed(4), dtype=D)
    for mode in ("rev", "fwd"):
        clear_cache(f)
        got = []
        for seed in range(4):
            torch.manual_seed(seed)
            J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
            assert bool(is_a_draw(J).all()), (mode, seed, J)
            got.append(J)
        assert not all(torch.equal(got[0], J) for J in got[1:]), mode


_W3 = _w(3, 3)
_SPARSE_INSIDE = {
    "mm": lambda x: (x.view(2, 3).to_sparse() @ _W3).reshape(-1),
    "mv": lambda x: torch.mv(x.view(2, 3).to_sparse(), torch.ones(3, dtype=D)),
    "addmm": lambda x: torch.addmm(torch.zeros(2, 3, dtype=D), x.view(2, 3).to_sparse(),
                                   _W3).reshape(-1),
    "values": lambda x: x.view(2, 3).to_sparse().values() * 2,
    "coalesce_values": lambda x: x.view(2, 3).to_sparse().coalesce().values() * 2,
    "dense_at_sparse": lambda x: (_W3.T @ x.view(3, 2).to_sparse()).reshape(-1),
}


@pytest.mark.parametrize("name", sorted(_SPARSE_INSIDE))
def test_a_sparse_tensor_built_from_x_inside_f_keeps_its_dependence(name):
    # a sparse tensor has no storage, so its set is kept by object; the product rules looked
    # up a reshaped or indexed copy (a new object, no set), and a sparse tensor's values()
    # (a view with storage of its own) had none either: an empty pattern, an all-zero J
    f = _SPARSE_INSIDE[name]
    x = torch.randn(6, generator=torch.Generator().manual_seed(5), dtype=D)
    ref = torch.autograd.functional.jacobian(f, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pattern = jacobian_sparsity(f, x).to_dense()
        J = sparse_jacobian(f, x, mode="rev", layout=torch.strided)
    assert not ((ref != 0) & ~pattern).any()
    torch.testing.assert_close(J, ref)


def _assign_twice(x):
    y = torch.zeros(2, dtype=D)
    y[[0, 0]] = x[:2]  # y[0] = x[1] (the last write), but both writers get its gradient
    return torch.cat([y, 3 * x[:1]])


def _add_into_repeated_columns(x):
    y = x[:4].view(2, 2).clone()
    y[:, [1, 1, 0]] += x[4:10].view(2, 3)
    return torch.cat([y.reshape(-1), 3 * x[:2]])


_REPEATED_WRITES = {
    "index_put": _assign_twice,
    "add_into_repeated_columns": _add_into_repeated_columns,
    "scatter": lambda x: torch.cat([torch.zeros(2, dtype=D).scatter(
        0, torch.tensor([0, 0]), x[:2]), 3 * x[:1]]),
    "index_copy": lambda x: torch.cat([torch.zeros(2, dtype=D).index_copy(
        0, torch.tensor([0, 0]), x[:2]), 3 * x[:1]]),
    "put": lambda x: torch.cat([torch.zeros(2, dtype=D).put(torch.tensor([0, -2]), x[:2]),
                                3 * x[:1]]),
}


@pytest.mark.parametrize("name", sorted(_REPEATED_WRITES))
def test_a_write_at_a_repeated_index_depends_on_every_writer(name):
    # an overwriting scatter with a repeated index kept only the last writer in the
    # pattern, but autograd's backward sends the element's gradient to every writer: in
    # reverse mode that gradient leaked into another row of the same colour (J[2, 0] = 4
    # where it is 3), silently
    f = _REPEATED_WRITES[name]
    x = torch.randn(10, generator=torch.Generator().manual_seed(6), dtype=D)
    for mode, ref in (("rev", torch.func.jacrev), ("fwd", torch.func.jacfwd)):
        clear_cache(f)
        J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
        torch.testing.assert_close(J, ref(f)(x))


def _copy_ints_into(x):
    y = x.clone()
    y[:2].copy_(torch.tensor([3, 1]))  # y[0], y[1] become constants
    return y


_INTEGER_DATA = {
    "cat_large": lambda x: torch.cat([x, torch.tensor([2024])]),
    "cat_small": lambda x: torch.cat([x, torch.arange(1, 4)]),
    "stack": lambda x: torch.stack([x, torch.tensor([1, 2, 3, 0])]).reshape(-1),
    "where": lambda x: torch.where(torch.tensor([True, False, True, False]), x,
                                   torch.tensor([1, 2, 3, 4])),
    "copy": _copy_ints_into,
}


@pytest.mark.parametrize("name", sorted(_INTEGER_DATA))
def test_integer_data_carries_no_dependence(name):
    # the data-movement rule ran the op on set ids but passed integer tensors through as
    # they were, so an integer data operand's values were read as set ids: a raw
    # IndexError for large ones, false dependencies for small ones
    f = _INTEGER_DATA[name]
    x = torch.randn(4, generator=torch.Generator().manual_seed(7), dtype=D)
    truth = torch.func.jacrev(f)(x).reshape(-1, 4) != 0
    assert torch.equal(jacobian_sparsity(f, x).to_dense(), truth)
    J = sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x).reshape(J.shape))


_BN3 = torch.nn.BatchNorm1d(3).double()


def _bn_in_a_closure():
    bn = torch.nn.BatchNorm1d(3).double()
    return bn, lambda x: bn(x) * 2


class _WithNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(3).double()

    def forward(self, x):
        return self.norm(x.sin())


def _bn_cases():
    own = torch.nn.BatchNorm1d(3).double()
    closed, by_closure = _bn_in_a_closure()
    partial_bn = torch.nn.BatchNorm1d(3).double()
    seq = _WithNorm()
    return {
        "module": (own, own),
        "global": (_BN3, lambda x: _BN3(x) + 1),
        "closure": (closed, by_closure),
        "partial": (partial_bn, functools.partial(lambda m, x: m(x), partial_bn)),
        "bound_method": (seq, seq.forward),
        "submodule": (seq.norm, seq),
    }


@pytest.mark.parametrize("name", ["module", "global", "closure", "partial", "bound_method",
                                  "submodule"])
def test_a_module_switched_between_eval_and_train_is_detected_again(name):
    # the plan cache was keyed by the function and x's shapes only: a BatchNorm switched
    # from eval() to train() kept the eval pattern (diagonal) for the batch-coupled
    # training Jacobian (12 non-zeros where there are 48), silently
    module, f = _bn_cases()[name]
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(8), dtype=D)
    for training in (False, True, False, True):
        module.train(training)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            J = sparse_jacobian(f, x, layout=torch.strided)
            ref = torch.autograd.functional.jacobian(f, x).reshape(12, 12)
        torch.testing.assert_close(J, ref)


def test_another_memory_layout_of_x_is_detected_again():
    # the cache key had no strides: an f that follows x's memory layout (as_strided) got
    # the pattern of the first layout at another one of the same shape
    def f(u):
        return u.as_strided((4,), (1,)) * 2.0

    a = torch.randn(2, 2, generator=torch.Generator().manual_seed(9), dtype=D)
    for x in (a, a.t(), a, a.t()):
        J = sparse_jacobian(f, x, layout=torch.strided)
        torch.testing.assert_close(J, torch.func.jacrev(f)(x).reshape(4, 4))


def test_a_pattern_shaped_by_a_random_number_is_the_one_of_the_products_draw():
    # a random number read into Python (a random shift) shapes the pattern: it is detected
    # at every call, but detection drew one shift and the products another, and the result
    # mixed the two (the Jacobian of no draw); the products now draw what detection drew
    n = 8
    x = torch.randn(n, generator=torch.Generator().manual_seed(11), dtype=D)

    def f(u):
        return u.roll(int(torch.randint(1, n, ()))) * u

    draws = [torch.func.jacrev(lambda u, k=k: u.roll(k) * u)(x) for k in range(1, n)]
    for mode in ("rev", "fwd", "auto"):
        for seed in range(4):
            torch.manual_seed(seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
            assert any(torch.allclose(J, R) for R in draws), (mode, seed)


# ---- what is not changed ---------------------------------------------------------------------


def test_nothing_is_mutated():
    bn = torch.nn.BatchNorm1d(3).double()  # training mode: detection runs it for real
    mean = bn.running_mean.clone()
    x = torch.randn(4, 3, dtype=D)
    x0 = x.clone()
    pattern = jacobian_sparsity(lambda u: _own_input_in_place(bn(u).reshape(-1)), x)
    assert torch.equal(x, x0) and torch.equal(bn.running_mean, mean)
    assert pattern._nnz() == 12 * 4  # each element: its channel across the batch
    J = sparse_jacobian(_own_input_in_place, x)
    assert torch.equal(x, x0) and J.shape == (12, 12)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc])
def test_each_result_owns_its_indices(layout):
    # the plan caches the index tensors; a result that shared them would change every
    # later result when the user changes it in place
    x = torch.randn(5, dtype=D)
    f = lambda u: u[1:] * u[:-1].exp()  # noqa: E731
    ref = torch.func.jacrev(f)(x)
    first = sparse_jacobian(f, x, layout=layout)
    if layout is torch.sparse_coo:
        first.t_()
    else:
        (first.crow_indices() if layout is torch.sparse_csr else first.ccol_indices()).zero_()
    again = sparse_jacobian(f, x, layout=layout)
    torch.testing.assert_close(again.to_dense(), ref)


class _Twice(torch.autograd.Function):
    """Forward and both modes of AD, but no vmap support."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def jvp(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_vmap_fallback_warns_and_computes():
    f = lambda x: _Twice.apply(x + x.roll(1))  # noqa: E731
    x = torch.randn(5, dtype=D)
    with pytest.warns(JacobianWarning, match=r"could not vectorise the JVPs.*one colour at a "
                                             r"time in a Python loop"):
        J = sparse_jacobian(f, x, mode="fwd")
    torch.testing.assert_close(J.to_dense(), _jac(lambda u: 2 * (u + u.roll(1)), x))


class _CumsumByNumPy(torch.autograd.Function):
    """A cumulative sum computed in NumPy (as a Function wrapping SciPy is): its forward runs
    no torch op on x, and its backward and jvp are torch's."""

    @staticmethod
    def forward(x):
        return torch.from_numpy(np.cumsum(x.detach().cpu().numpy()))

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g.flip(0).cumsum(0).flip(0)

    @staticmethod
    def jvp(ctx, t):
        return t.cumsum(0)


class _StraightThrough(torch.autograd.Function):
    """Rounds elementwise in forward; its derivative (backward and jvp) couples neighbours."""

    @staticmethod
    def forward(x):
        return x.round()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g + g.roll(1)

    @staticmethod
    def jvp(ctx, t):
        return t + t.roll(-1)


_CUMSUM_OP = _CumsumByNumPy.apply  # (bound before any detection, as libraries do)


@pytest.mark.parametrize("case", ["numpy_forward", "numpy_bound_early", "straight_through",
                                  "numpy_inside_grad"])
@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
def test_a_custom_function_is_ruled_by_its_derivative_not_its_forward(case, mode):
    # the tracer followed the forward's ops: a forward in NumPy gave its outputs no set (the
    # sparse Jacobian was silently zero there), and a straight-through estimator the
    # forward's diagonal, not the backward's structure
    f = {"numpy_forward": lambda u: _CumsumByNumPy.apply(u[:4]) * u[4:],
         "numpy_bound_early": _CUMSUM_OP,
         "straight_through": lambda u: _StraightThrough.apply(u) * 2,
         # (the rule runs inside torch.func.grad: its own work must stay outside it)
         "numpy_inside_grad": lambda u: torch.func.grad(
             lambda v: (_CumsumByNumPy.apply(v) ** 2).sum())(u)}[case]
    x = torch.randn(8, dtype=D)
    ref = torch.autograd.functional.jacobian(f, x)
    pattern = _dense(jacobian_sparsity(f, x))
    assert not (ref != 0)[~pattern].any(), "entries missing from the pattern"
    J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
    torch.testing.assert_close(J, ref)


def test_a_custom_function_whose_rule_fails_depends_on_everything(monkeypatch):
    # (an error in the profile function would end it and reach f)
    from torch_vjp._sparse import functions

    def broken(*args):
        raise ValueError("the rule's own failure")

    monkeypatch.setattr(functions, "_rule", broken)
    x = torch.randn(5, dtype=D)
    pattern = _dense(jacobian_sparsity(lambda u: _StraightThrough.apply(u[:3]) * 2, x))
    assert pattern.all() and pattern.shape == (3, 5)


def test_a_custom_function_is_named_in_the_conservative_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jacobian_sparsity(lambda u: _StraightThrough.apply(u * 2), torch.randn(4, dtype=D))
    messages = [str(w.message) for w in caught if issubclass(w.category, JacobianWarning)]
    assert any("no sparsity rule for _StraightThrough (a custom autograd.Function)" in m
               for m in messages), messages


def test_a_custom_function_keeps_the_profile_function_and_sparse_neighbours():
    seen = []

    def profile(frame, event, arg):
        seen.append(event)

    f = lambda u: torch.cat([_CumsumByNumPy.apply(u[:3]), u[3:] ** 2])  # noqa: E731
    sys.setprofile(profile)
    try:
        pattern = _dense(jacobian_sparsity(f, torch.randn(6, dtype=D)))
    finally:
        kept = sys.getprofile()
        sys.setprofile(None)
    assert kept is profile
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:3, :3] = True  # (the Function: every output on every input it read)
    expected[3:, 3:] = torch.eye(3, dtype=torch.bool)  # (the rest keeps its structure)
    assert torch.equal(pattern, expected)


def test_a_reentrant_checkpoint_keeps_its_blocks_structure():
    # torch.utils.checkpoint(use_reentrant=True) runs the block in an autograd.Function
    # whose backward differentiates the block again: ruled as a custom Function, the
    # block's pattern was dense (and named in a warning)
    from torch.utils.checkpoint import checkpoint

    def block(u):
        return torch.sin(u) * u.roll(1)

    x = torch.randn(6, dtype=D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pattern = _dense(jacobian_sparsity(
            lambda u: checkpoint(block, u, use_reentrant=True) * 2, x))
    assert torch.equal(pattern, _dense(jacobian_sparsity(block, x)))
    assert pattern.sum() == 12
    assert not any("CheckpointFunction" in str(w.message) for w in caught)


def _marker_inside_f(u):
    return u * 3


def test_detection_keeps_cprofile_running():
    # sys.getprofile() is cProfile's Profile object (before Python 3.12), which cannot be
    # called: putting it back with sys.setprofile made the next event raise TypeError
    # ('Profile' object is not callable) out of sparse_jacobian, and ended the profiler
    import cProfile
    import pstats

    f = lambda u: torch.cat([_CumsumByNumPy.apply(u[:3]), u[3:] ** 2])  # noqa: E731
    x = torch.randn(6, dtype=D)
    prof = cProfile.Profile()
    prof.enable()
    try:
        J = sparse_jacobian(f, x, layout=torch.strided)
        after = _marker_inside_f(x)
    finally:
        prof.disable()
    torch.testing.assert_close(J, torch.autograd.functional.jacobian(f, x))
    torch.testing.assert_close(after, x * 3)
    names = {fn for (_, _, fn) in pstats.Stats(prof).stats}
    assert "_marker_inside_f" in names  # (still profiling after the detection)


def test_detection_under_torch_profiler_with_stacks_warns_it_stopped_it():
    # torch's profiler sets a C profile function whose object is not callable: putting it
    # back with sys.setprofile raised TypeError ('TraceContext' object is not callable)
    f = lambda u: u.sin() * u.roll(1)  # noqa: E731
    x = torch.randn(5, dtype=D)
    with torch.profiler.profile(with_stack=True):
        if sys.getprofile() is None or callable(sys.getprofile()):
            pytest.skip("this torch's profiler sets no C profile function")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            J = sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(J, torch.func.jacrev(f)(x))
    messages = [str(w.message) for w in caught if issubclass(w.category, JacobianWarning)]
    assert any("sparsity detection replaced this thread's profile function" in m
               and "Fix: detect outside the profiler" in m for m in messages), messages


def test_detection_passes_every_event_to_the_users_profile_function():
    # the user's profile function saw nothing of f while detection ran
    seen = []

    def profile(frame, event, arg):
        seen.append(frame.f_code.co_name)

    f = lambda u: _marker_inside_f(u) ** 2  # noqa: E731
    sys.setprofile(profile)
    try:
        jacobian_sparsity(f, torch.randn(4, dtype=D))
    finally:
        sys.setprofile(None)
    assert "_marker_inside_f" in seen


def test_op_without_a_rule_warns_once():
    clear_cache()
    f = lambda x: torch.fft.rfft(x).real  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("always", category=JacobianWarning)
        jacobian_sparsity(f, torch.randn(8))
    messages = [str(w.message) for w in caught if issubclass(w.category, JacobianWarning)]
    if messages:  # (another test of this process may have seen this function's op first)
        assert "no sparsity rule for aten._fft_r2c" in messages[0]
        assert "pass it as pattern=" in messages[0]


def test_empty_input_and_output():
    J = sparse_jacobian(lambda x: x[:0] * 2, torch.randn(3, dtype=D))
    assert J.shape == (0, 3) and J.values().numel() == 0
    J = sparse_jacobian(lambda x: torch.zeros(2, dtype=D) + x.sum(), torch.randn(0, dtype=D))
    assert J.shape == (2, 0)


@pytest.mark.cuda
def test_cuda():
    x = torch.randn(36, dtype=D, device="cuda")
    for mode in ("fwd", "rev"):
        J = sparse_jacobian(_stencil_2d, x, mode=mode)
        assert J.device.type == "cuda"
        torch.testing.assert_close(J.to_dense(), _jac(_stencil_2d, x))
    assert jacobian_sparsity(_stencil_2d, x).device.type == "cuda"


# ---- errors -----------------------------------------------------------------------------------


def test_sparse_jacobian_err_check():
    x = torch.randn(6, dtype=D)
    with pytest.raises(StrategyError, match=r"mode='forward' is not a mode\. Valid modes: "
                                            r"'auto'.*'fwd'.*'rev'"):
        sparse_jacobian(torch.sin, x, mode="forward")
    with pytest.raises(JacobianOptionError, match=r"layout=torch.sparse_bsr is not a layout.*"
                                                  r"torch.strided for a dense \(m, n\)"):
        sparse_jacobian(torch.sin, x, layout=torch.sparse_bsr)
    with pytest.raises(JacobianCallTypeError, match=r"pattern is a list, but it must be a "
                                                    r"boolean tensor of shape \(m, n\).*Fix: "
                                                    r"pass torch_vjp.jacobian_sparsity"):
        sparse_jacobian(torch.sin, x, pattern=[[True]])
    with pytest.raises(JacobianOptionError, match=r"pattern has shape \(6,\), but it must be "
                                                  r"2-D.*here n = 6"):
        sparse_jacobian(torch.sin, x, pattern=torch.ones(6, dtype=torch.bool))
    with pytest.raises(JacobianOptionError, match=r"pattern has shape \(6, 5\), so 5 columns, "
                                                  r"but x has 6 elements: column j is element j "
                                                  r"of x flattened"):
        sparse_jacobian(torch.sin, x, pattern=torch.ones(6, 5, dtype=torch.bool))
    with pytest.raises(JacobianOptionError, match=r"pattern has shape \(4, 6\), so 4 rows, but "
                                                  r"f returned 6 output elements: row i is "
                                                  r"element i of f's output flattened"):
        sparse_jacobian(torch.sin, x, pattern=torch.ones(4, 6, dtype=torch.bool))
    with pytest.raises(JacobianOptionError, match=r"chunk_size=0"):
        sparse_jacobian(torch.sin, x, chunk_size=0)
    with pytest.raises(JacobianOptionError, match=r"max_memory='1G' is ambiguous"):
        sparse_jacobian(torch.sin, x, max_memory="1G")
    with pytest.raises(JacobianCallError, match=r"has dtype torch.int64, but only "
                                                r"floating-point tensors can be differentiated"):
        sparse_jacobian(torch.sin, torch.arange(3))
    with pytest.raises(JacobianCallTypeError, match=r"f is a str, but it must be a callable"):
        sparse_jacobian("sin", x)
    with pytest.raises(JacobianCallError, match=r"only real floating-point outputs have a "
                                                r"Jacobian"):
        sparse_jacobian(lambda u: (u > 0), x)


@pytest.mark.parametrize("layout", [torch.strided, torch.sparse_coo])
def test_a_pattern_on_the_meta_device_is_refused_with_an_explanation(layout):
    # a meta pattern has no values to read: torch's raw NotImplementedError came through
    pattern = torch.ones(4, 4, device="meta")
    if layout is torch.sparse_coo:
        pattern = torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1),
                                          (4, 4), device="meta")
    with pytest.raises(JacobianOptionError) as err:
        sparse_jacobian(lambda t: t, torch.ones(4, dtype=D), pattern=pattern)
    assert re.match(r"torch_vjp\.sparse_jacobian: pattern is on the meta device, so it has "
                    r"no values to read .* Fix: pass torch_vjp\.jacobian_sparsity\(f, x\)",
                    full_message(err.value))


def test_inside_a_transform_is_refused():
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(JacobianCallError, match=r"called inside a torch.func transform.*Fix: "
                                                r"call it outside the transform"):
        torch.func.vmap(lambda r: sparse_jacobian(torch.sin, r).to_dense())(x)


@pytest.mark.parametrize("pattern", [None, torch.eye(4, dtype=torch.bool)], ids=["detect", "user"])
@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_errors_of_f_pass_through_untouched(pattern, mode):
    class Mine(ValueError):
        pass

    def f(x):
        raise Mine("f's own error")

    with pytest.raises(Mine, match="f's own error") as info:
        sparse_jacobian(f, torch.randn(4, dtype=D), pattern=pattern, mode=mode)
    assert type(info.value) is Mine and full_message(info.value) == "f's own error"
    with pytest.raises(Mine):
        jacobian_sparsity(f, torch.randn(4, dtype=D))


def test_jacobian_sparsity_err_check():
    with pytest.raises(JacobianCallError, match=r"x is a sparse tensor"):
        jacobian_sparsity(torch.sin, torch.eye(3).to_sparse())
    with pytest.raises(JacobianCallTypeError, match=r"f is an int"):
        jacobian_sparsity(3, torch.ones(2))


def test_partial_and_module_functions():
    f = functools.partial(torch.mul, 2.0)
    x = torch.randn(5, dtype=D)
    torch.testing.assert_close(sparse_jacobian(f, x).to_dense(), 2 * torch.eye(5, dtype=D))
    torch.testing.assert_close(sparse_jacobian(torch.sin, x).to_dense(), torch.diag(x.cos()))


def test_public_names():
    assert tv.sparse_jacobian is sparse_jacobian and tv.jacobian_sparsity is jacobian_sparsity
    assert {"sparse_jacobian", "jacobian_sparsity"} <= set(tv.__all__)
    assert tv.sparse.clear_cache is clear_cache
    assert torch.vjp.sparse_jacobian is sparse_jacobian  # the torch namespace plugin


def test_auto_takes_reverse_mode_where_forward_mode_fails_with_a_warning():
    # auto chose forward mode (fewer colours) and torch's raw NotImplementedError came out
    u = torch.randn(6, dtype=torch.float64)

    def f(u):  # torch.cdist has no forward-mode formula (one row of x2: fewer columns)
        return torch.cdist(u.view(6, 1), u.view(6, 1)[:1] + 1).flatten()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tv.sparse_jacobian(f, u)
    assert [w for w in caught if re.search(r"forward-mode AD fails on f \(.*f\), so "
                                           r"strategy='auto' uses reverse mode", str(w.message))]
    # (torch.func.jacrev is wrong here: cdist's backward has a wrong batching rule, which
    # 'auto' finds, NOTE [auto, checked once])
    torch.testing.assert_close(got.to_dense(), torch.autograd.functional.jacobian(f, u))
    with pytest.raises(StrategyError) as err:  # mode='fwd' asked for: explained
        tv.sparse_jacobian(f, u, mode="fwd")
    assert re.match(r"torch_vjp\.sparse_jacobian: mode='fwd' computes the products with "
                    r"forward-mode AD, and an operator in f has no forward-mode formula .*\n"
                    r"  torch said: NotImplementedError: .*\n  Fix: mode='rev' or 'auto'",
                    full_message(err.value))
    assert isinstance(err.value, NotImplementedError)  # as torch raised: except clauses hold


_CSR = _w(4, 4).to_sparse_csr()
_COO = _w(4, 4).to_sparse()


def test_an_explicit_reverse_mode_explains_saved_tensor_hooks():
    # torch.func's reverse mode refuses saved tensor hooks (checkpointing): with mode='rev',
    # its raw RuntimeError came through; 'auto' computes such a function
    import torch.utils.checkpoint

    def f(x):
        return torch.utils.checkpoint.checkpoint(lambda v: v.sin() * v.roll(1), x,
                                                 use_reentrant=False)

    x = torch.randn(6, generator=torch.Generator().manual_seed(13), dtype=D)
    with pytest.raises(StrategyError) as err:
        sparse_jacobian(f, x, mode="rev")
    assert re.match(r"torch_vjp\.sparse_jacobian: mode='rev' computes the products with "
                    r"torch\.func, which cannot run f \(.*f\): f uses saved tensor hooks .*\n"
                    r"  torch\.func said: RuntimeError: .*\n  Fix: mode='auto' .* or "
                    r"mode='fwd'\.", full_message(err.value))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(J, torch.autograd.functional.jacobian(f, x))


def test_an_explicit_forward_mode_explains_a_sparse_operand():
    # forward mode has no zero tangent for a sparse COO operand: torch's raw
    # NotImplementedError (_efficientzerotensor on SparseCPU) came through
    def f(x):
        return _COO @ x

    x = torch.randn(4, generator=torch.Generator().manual_seed(12), dtype=D)
    with pytest.raises(StrategyError) as err:
        sparse_jacobian(f, x, mode="fwd")
    assert re.match(r"torch_vjp\.sparse_jacobian: mode='fwd' computes the products with "
                    r"forward-mode AD, and f multiplies by a sparse tensor, for which torch's "
                    r"forward mode has no kernel .*\n  torch said: NotImplementedError: .*\n"
                    r"  Fix: mode='rev' or 'auto'", full_message(err.value))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = sparse_jacobian(f, x, layout=torch.strided)
    torch.testing.assert_close(J, _COO.to_dense())


@pytest.mark.parametrize("mode", ["fwd", "rev"])
@pytest.mark.parametrize("case", ["batch_norm_training", "sparse_csr_constant"])
def test_an_explicit_mode_explains_what_torch_func_refuses(case, mode):
    # with mode='fwd' or 'rev', torch.func's refusals came through as torch's raw errors,
    # where torch_vjp.jacobian(strategy=...) explains them; 'auto' computes them
    bn = torch.nn.BatchNorm1d(3).double().train()
    f = {"batch_norm_training": lambda x: bn(x.view(4, 3)).reshape(-1),
         "sparse_csr_constant": lambda x: _CSR @ x[:4]}[case]
    x = torch.randn(12, generator=torch.Generator().manual_seed(10), dtype=D)
    with pytest.raises(StrategyError) as err:
        sparse_jacobian(f, x, mode=mode)
    what = {"batch_norm_training": r"f changes a tensor it captured in place",
            "sparse_csr_constant": r"f uses a tensor without strides"}[case]
    assert re.match(
        rf"torch_vjp\.sparse_jacobian: mode='{mode}' computes the products with torch\.func, "
        rf"which cannot run f \(.*<lambda>\): {what}.*\n  torch\.func said: RuntimeError: .*\n"
        rf"  Fix: mode='auto'", full_message(err.value))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        J = sparse_jacobian(f, x, mode="auto", layout=torch.strided)
    if case == "sparse_csr_constant":
        torch.testing.assert_close(J, torch.autograd.functional.jacobian(f, x))


def test_auto_takes_plain_autograd_where_torch_func_cannot_run_f(fresh_route_checks):
    # a module in training mode updates its running statistics, which torch.func refuses;
    # the dense 'auto' computes it with plain autograd, and sparse 'auto' raised torch.func's
    # RuntimeError
    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)).double().train()
    x = torch.randn(4, 3, dtype=D)
    mean, var = net[1].running_mean.clone(), net[1].running_var.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        J = tv.sparse_jacobian(net, x, layout=torch.strided)
    assert [w for w in caught if re.match(
        r"torch_vjp\.sparse_jacobian: torch\.func cannot run f \(Sequential\): f changes a "
        r"tensor it captured in place .* mode='auto' computed the products with plain "
        r"autograd, one backward pass per colour", str(w.message))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J2 = tv.sparse_jacobian(net, x, layout=torch.strided)  # the remembered route too
    assert torch.equal(net[1].running_mean, mean) and torch.equal(net[1].running_var, var)
    ref = torch.autograd.functional.jacobian(lambda u: net(u), x).reshape(12, 12)
    torch.testing.assert_close(J, ref)
    torch.testing.assert_close(J2, ref)


class _DoubleInPlace(torch.autograd.Function):
    """2 x, whose backward scales its grad_output in place (legal, if unusual)."""

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g.mul_(2)


@pytest.mark.parametrize("mode", ["rev", "fwd", "auto"])
def test_products_that_write_into_their_seeds_do_not_change_the_next_call(mode):
    # the kept seed rows were handed out themselves: a backward that scales grad_output in
    # place (reverse mode), or a function that writes into its input (forward mode), scaled
    # them, and every later call of the plan was wrong
    x = torch.randn(6, dtype=D)
    f = _DoubleInPlace.apply if mode == "rev" else _writes_in_place
    ref = torch.autograd.functional.jacobian(lambda u: f(u.clone()), x)
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tv.JacobianWarning)
            J = tv.sparse_jacobian(f, x, mode=mode, layout=torch.strided)
        torch.testing.assert_close(J, ref)


def _writes_in_place(x):
    x.mul_(2)
    return x.sin()


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
@pytest.mark.parametrize("name", ["softmax", "centred"])
def test_the_probe_of_dense_rows_in_bfloat16_agrees(mode, name, monkeypatch):
    # rows of 512 terms: the probe product read from the values was summed in bfloat16
    # (index_add_ in the products' dtype), off by up to 0.99 in a row of scale 1.2: a valid
    # pattern of the user's was refused with a JacobianOptionError, and a detected plan
    # was detected again and no longer probed
    import torch_vjp.sparse as sp

    f = {"softmax": lambda u: torch.softmax(u, 0), "centred": lambda u: u - u.mean()}[name]
    x = torch.randn(512, generator=torch.Generator().manual_seed(0)).bfloat16()
    full = torch.ones(512, 512, dtype=torch.bool)
    for _ in range(2):
        sparse_jacobian(f, x, pattern=full, mode=mode)  # (raised)
    detections = _Counter(sp.detect)
    monkeypatch.setattr(sp, "detect", detections)
    for _ in range(2):
        sparse_jacobian(f, x, mode=mode)
    assert detections.calls == 1


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
def test_a_users_exact_pattern_of_f_with_a_part_under_autocast_is_not_refused(mode):
    # a float32 output, part of it computed in bfloat16 under autocast: the probe (judged
    # in float32, element by element) disagreed in the bfloat16 rows, and the additivity
    # test, judged at the scale of the whole product, passed (the float32 part is ten times
    # larger): the exact pattern was refused with a JacobianOptionError in "fwd" and "auto"
    lin = torch.nn.Linear(64, 64)

    def f(u):
        h = u.view(-1, 64)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(h)
        return torch.cat([(10 * h).reshape(-1), y.float().reshape(-1)])

    x = torch.randn(4 * 64, generator=torch.Generator().manual_seed(0))
    pattern = tv.jacobian_sparsity(f, x)
    for _ in range(3):
        J = sparse_jacobian(f, x, pattern=pattern, mode=mode, layout=torch.strided)
    want = torch.func.jacrev(f)(x)
    torch.testing.assert_close(J, want, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_a_users_pattern_that_misses_entries_beside_a_larger_part_is_still_refused(mode):
    # (the additivity test at the probe's scale passes for an f computed in its dtype)
    f = lambda u: torch.cat([100 * u, u * u.roll(1)])  # noqa: E731
    x = torch.randn(50, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    eye = torch.eye(50, dtype=torch.bool)
    with pytest.raises(tv.JacobianOptionError, match="leaves out non-zeros"):
        for _ in range(2):
            sparse_jacobian(f, x, pattern=torch.cat([eye, eye]), mode=mode)


@pytest.mark.parametrize("mode", ["auto", "fwd", "rev"])
def test_a_changed_branch_beside_a_bfloat16_output_is_found(mode):
    # 25b2e41 judged every element of the probe within the coarsest dtype of all outputs:
    # beside a bfloat16 output, the float32 output's rows were judged within bfloat16's
    # tolerance (0.088), and a branch change there worth 2.5% of its rows went unseen
    # (the entries of u.roll(3) gathered from u.roll(1)'s plan, 0.17 off, silently)
    flag = [1]
    f = lambda u: (u * u + 0.05 * u * u.roll(flag[0]), (u[:8] * 2).bfloat16())  # noqa: E731
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        sparse_jacobian(f, x, mode=mode)
    flag[0] = 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        J = sparse_jacobian(f, x, mode=mode, layout=torch.strided)
    want = torch.cat([t.reshape(-1, 64).float() for t in torch.func.jacrev(f)(x)])
    torch.testing.assert_close(J.float(), want, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_users_pattern_probed_at_a_nan_point_is_still_probed_at_a_finite_one(mode, bad):
    # a probe at a point holding a NaN or an infinity disagreed (or went unchecked) and
    # turned probing off for the function: the next call, at a finite point, with a pattern
    # that leaves out entries, was silently 1.6 off
    x = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0))
    diag = torch.eye(5, dtype=torch.bool)
    f = lambda u: u * u.roll(1)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        sparse_jacobian(f, torch.where(torch.arange(5) == 2, bad, x), pattern=diag, mode=mode)
        with pytest.raises(tv.JacobianOptionError, match="pattern leaves out non-zeros"):
            sparse_jacobian(f, x, pattern=diag, mode=mode)


def test_auto_with_an_infinity_in_a_captured_tensor_warns_and_remembers_nothing():
    # an infinity in a tensor f captured (x finite) reaches the products of each route its
    # own way: 'auto' warned 'reverse mode under torch.vmap disagrees ... (by up to nan)' of
    # a correct f and remembered the loop for it
    x = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0))
    w = torch.tensor([1.0, float("inf"), -2.0, 0.5, 3.0], dtype=D)
    f = lambda u: u * u.roll(1) * w  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        sparse_jacobian(f, x)


@pytest.mark.parametrize("mode", ["fwd", "rev"])
def test_a_users_pattern_probed_with_an_inf_in_a_captured_tensor_is_still_probed(mode):
    # x finite, an infinity in a tensor f captures: the probe's products held NaN, it
    # disagreed, and probing stopped for good; the next finite call with a pattern that
    # leaves out entries was silently 2.18 off
    x = torch.randn(5, dtype=D, generator=torch.Generator().manual_seed(0))
    c = torch.ones(5, dtype=D)
    diag = torch.eye(5, dtype=torch.bool)
    f = lambda u: u * u.roll(1) * c  # noqa: E731
    c[2] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tv.JacobianWarning)
        sparse_jacobian(f, x, pattern=diag, mode=mode)
    c[2] = 1.0
    with pytest.raises(tv.JacobianOptionError, match="pattern leaves out non-zeros"):
        sparse_jacobian(f, x, pattern=diag, mode=mode)


def test_auto_check_allows_a_float32_step_inside_a_float64_function():
    # A stencil then an elementwise step in float32: every mode rounds at float32's, and
    # "auto" warned that no mode agreed with the reverse product (by 0.000169 at a scale
    # of 9.12e+03), as if f were random.
    def f(x):
        y = x[:-2] - 2 * x[1:-1] + x[2:]
        return (y.float() * 3.7).tanh().exp().double() * x[1:-1] ** 2 * 1e3

    x = torch.randn(40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tv.JacobianWarning)
        got = tv.sparse_jacobian(f, x)
    torch.testing.assert_close(got.to_dense(), torch.func.jacrev(f)(x), rtol=0, atol=1e-12)
